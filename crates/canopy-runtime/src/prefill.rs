//! How a prompt's keys and values reach a rank's caches:
//! - the prefill of `generate`: the prompt in pieces ([`KvLayout::pieces`]), each through
//!   every layer, every rank running its chunk of the piece; a layer's queries are gathered
//!   from every rank, each rank attends them to the prompt keys it holds (read from its
//!   cache), and the partial states merge across ranks, as decode's do;
//! - a chunk of a prompt whose earlier tokens are cached already (a shared prefix, earlier
//!   chunks), as a server prefills: every rank runs the chunk's rows, which attend causally
//!   to themselves and, through the engine's [`RankAttention`] over a plan of the cached
//!   context, to the KV in the paged pools of every rank;
//! - a random fill that stands in for a prefill when only decode is timed.
//!
//! Each runs its rows through the layers the same way ([`through_layers`]); only how a
//! layer's queries attend differs.

use crate::kv::KvLayout;
use crate::layers::{ModelLayers, Qkv};
use crate::rank::GenerateRequest;
use crate::Result;
use canopy_comm::{Collective, ReduceOp};
use canopy_core::data::splitmix64;
use canopy_engine::{
    Backend, CachedKeys, FillRun, KeyBlock, LayerOps, MergeCollective, NodeLayout, RankAttention,
    StatesMerge, Transport,
};
use std::borrow::Cow;
use std::ops::Range;

/// The rows of one prefill pass.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PrefillRows<'a> {
    pub ids: &'a [u32],
    pub positions: &'a [u32],
    /// `(row, physical slot)` of the rows whose key and value this rank stores.
    pub stores: &'a [(u32, u32)],
}

/// How one layer's queries attend, given the layer's cache, its q, k and v (theirs to keep: q
/// may become the queries of an attention without a copy), and the rows whose output is read
/// (`None`: every row): writes those rows' attention output (`rows × q_heads · head_dim`, in
/// the order given) into the last argument.
type Attend<'a, B> = dyn FnMut(&<B as Backend>::Kv, Qkv<B>, Option<&[usize]>, &mut <B as LayerOps>::Tensor) -> Result<()>
    + 'a;

/// `rows` through every layer, each row's key and value stored in `caches` (one per layer),
/// each layer's queries attending by `attend`, and `on_layer(layers done)` told after each.
/// Returns the last layer's hidden rows: every row's, or with `read` only those rows' (in
/// that order). The last layer's attention and MLP then run for those rows alone, since no
/// other row's output is read: a prompt's prefill reads its last row only, and a piece
/// without it none (its last layer stores keys and values, and nothing more).
fn through_layers<B: LayerOps>(
    backend: &B,
    layers: &ModelLayers<B>,
    caches: &mut [B::Kv],
    rows: PrefillRows,
    read: Option<&[usize]>,
    attend: &mut Attend<B>,
    on_layer: &mut dyn FnMut(usize),
) -> Result<B::Tensor> {
    let mut x = layers.embed(backend, rows.ids)?;
    let mut attn = layers.attention_output(backend, rows.ids.len())?;
    let last = caches.len().saturating_sub(1);
    for (l, cache) in caches.iter_mut().enumerate() {
        let qkv = layers.qkv(backend, l, &x, rows.positions, Some((cache, rows.stores)))?;
        match read.filter(|_| l == last) {
            None => {
                attend(cache, qkv, None, &mut attn)?;
                layers.finish(backend, l, &mut x, &attn)?;
            }
            Some([]) => {}
            Some(read) => {
                let mut attn = layers.attention_output(backend, read.len())?;
                attend(cache, qkv, Some(read), &mut attn)?;
                let mut kept = backend.output_tensor(read.len(), backend.dims(&x).1)?;
                backend.gather_rows(&x, read, &mut kept)?;
                layers.finish(backend, l, &mut kept, &attn)?;
                x = kept;
            }
        }
        on_layer(l + 1);
    }
    Ok(x)
}

/// Prompt chunks of one or more requests whose earlier tokens are in the caches, in one pass,
/// maybe beside a step's decode rows: the rows of each of `chunks` (ranges of `rows`) attend
/// causally to one another, and through `cached` (a plan with one query per row: a chunk's
/// rows on the node that ends its cached context, a decode row on its branch; `None` when no
/// row has one), every row attends to the earlier tokens on every rank. Every rank runs every
/// row and gets the same result; returns the last layer's hidden rows.
pub(crate) fn prefill_chunks<B: LayerOps, C: Transport<B>>(
    backend: &B,
    layers: &ModelLayers<B>,
    caches: &mut [B::Kv],
    mut cached: Option<&mut RankAttention<B, C>>,
    rows: PrefillRows,
    chunks: &[Range<usize>],
) -> Result<B::Tensor> {
    let shape = layers.attn_shape();
    let n = rows.ids.len();
    let windows = ChunkWindows::new(rows.positions, chunks);
    let attend = &mut |cache: &B::Kv, qkv: Qkv<B>, _: Option<&[usize]>, out: &mut B::Tensor| {
        let mut states = backend.empty_states(&shape, n)?;
        let own = KeyBlock {
            k: &qkv.k,
            v: &qkv.v,
            positions: &windows.k_pos,
            dtype: backend.kv_dtype(cache),
        };
        let q_from = windows.q_from.as_deref();
        backend.causal_attention_from(&shape, &qkv.q, &windows.q_pos, q_from, own, &mut states)?;
        if let Some(cached) = cached.as_deref_mut() {
            let q = backend.take_queries(&shape, qkv.q)?;
            if backend.merge_into_output(&mut states, cached.attend(cache, &q)?, out)? {
                return Ok(());
            }
        }
        Ok(backend.states_output(&states, out)?)
    };
    through_layers(backend, layers, caches, rows, None, attend, &mut |_| {})
}

/// The causal attention of a pass's chunks, each to its own keys, as one block of the pass's
/// keys. One chunk of every row attends at the rows' positions. Otherwise the rows are
/// numbered from 1 as positions, and each chunk's rows see the keys from the chunk's first row
/// to their own ([`LayerOps::causal_attention_from`]); a row of no chunk (a decode row) is at
/// 0 with an empty window, and sees none.
struct ChunkWindows {
    q_pos: Vec<u32>,
    /// `None`: one chunk of every row.
    q_from: Option<Vec<u32>>,
    k_pos: Vec<u32>,
}

impl ChunkWindows {
    fn new(positions: &[u32], chunks: &[Range<usize>]) -> Self {
        if chunks == [0..positions.len()] {
            return ChunkWindows {
                q_pos: positions.to_vec(),
                q_from: None,
                k_pos: positions.to_vec(),
            };
        }
        let numbered = |r: usize| r as u32 + 1;
        let mut q_pos = vec![0; positions.len()];
        let mut q_from = vec![u32::MAX; positions.len()];
        for c in chunks {
            for r in c.clone() {
                q_pos[r] = numbered(r);
                q_from[r] = numbered(c.start);
            }
        }
        ChunkWindows {
            q_pos,
            q_from: Some(q_from),
            k_pos: (0..positions.len()).map(numbered).collect(),
        }
    }
}

/// The prompt through every layer, piece by piece ([`KvLayout::pieces`]), each rank running
/// its chunk of each piece and storing its keys and values where `kv` places them;
/// `on_pass(done, passes)` is told after each layer of each piece. Returns the first token's
/// logits (the same on every rank).
///
/// A rank's chunk of a piece is padded to the piece's widest chunk (copies of the piece's last
/// token, stored nowhere, their outputs unused), so that every rank gathers the same rows. At
/// each layer, every rank attends the piece's gathered queries to the prompt keys it holds so
/// far, its chunks of this piece and the earlier ones, where its cache keeps them (a query
/// sees the keys at or before its position); the partial states merge across ranks, and each
/// rank keeps its own rows. A rank's attention work is its share of the keys, and the
/// activations are bounded by the piece, not the prompt.
pub(crate) fn prefill<B: LayerOps, C: Collective + Transport<B>>(
    backend: &B,
    layers: &ModelLayers<B>,
    req: &GenerateRequest,
    comm: &C,
    kv: &KvLayout,
    caches: &mut [B::Kv],
    on_pass: &mut dyn FnMut(usize, usize),
) -> Result<Vec<f32>> {
    let (rank, ranks) = (comm.rank(), comm.size());
    let shape = layers.attn_shape();
    let num_layers = layers.num_layers();
    let passes = kv.pieces().len() * num_layers;
    let layout = NodeLayout::single(ranks);
    let last = req.prompt.len() - 1;
    let mut logits = vec![0.0; layers.config.vocab_size];
    let mut held = HeldKeys::default();
    for (j, piece) in kv.pieces().iter().enumerate() {
        let chunks = kv.chunks(piece);
        let width = chunks.iter().map(|c| c.len()).max().unwrap_or(0).max(1);
        let padded = |c: &Range<usize>| {
            let pad = width - c.len();
            c.clone().chain(std::iter::repeat_n(piece.end - 1, pad))
        };
        let own = chunks[rank].clone();
        let ids: Vec<u32> = padded(&own).map(|p| req.prompt[p]).collect();
        let positions: Vec<u32> = padded(&own).map(|p| p as u32).collect();
        let own_slots = kv.prompt_slots(own.clone());
        let stores: Vec<(u32, u32)> = own_slots
            .iter()
            .enumerate()
            .map(|(row, &slot)| (row as u32, slot))
            .collect();
        held.slots.extend(&own_slots);
        held.positions.extend(own.clone().map(|p| p as u32));
        let gathered: Vec<u32> = chunks.iter().flat_map(padded).map(|p| p as u32).collect();
        let cols = shape.q_row_elems();
        let mut exchange = match ranks {
            1 => None,
            _ => Some(Exchange {
                merge: StatesMerge::new(
                    backend,
                    gathered.len() * shape.q_heads,
                    shape.head_dim,
                    ranks,
                )?,
                q: backend.tensor(gathered.len(), cols)?,
                out: backend.tensor(gathered.len(), cols)?,
            }),
        };
        let held = &held;
        let attend =
            &mut |cache: &B::Kv, qkv: Qkv<B>, read: Option<&[usize]>, out: &mut B::Tensor| {
                let Some(ex) = exchange.as_mut() else {
                    let (picked, q_pos): (_, Cow<[u32]>) = match read {
                        None => (None, Cow::Borrowed(&positions)),
                        Some(read) => {
                            let mut q = backend.output_tensor(read.len(), cols)?;
                            backend.gather_rows(&qkv.q, read, &mut q)?;
                            (Some(q), read.iter().map(|&r| positions[r]).collect())
                        }
                    };
                    let q = picked.as_ref().unwrap_or(&qkv.q);
                    let keys = held.in_cache(cache);
                    return Ok(backend.cached_attention_output(&shape, q, &q_pos, keys, out)?);
                };
                let mine = backend.tensor_buf(&qkv.q);
                comm.all_gather_buf(
                    backend,
                    mine,
                    width * cols,
                    backend.tensor_buf_mut(&mut ex.q),
                )?;
                let mut states = backend.empty_states(&shape, gathered.len())?;
                let keys = held.in_cache(cache);
                backend.cached_attention(&shape, &ex.q, &gathered, keys, &mut states)?;
                let how = MergeCollective::Allreduce2;
                ex.merge.run(backend, comm, &mut states, how, &layout)?;
                backend.states_output(&states, &mut ex.out)?;
                let own_rows: Vec<usize> = match read {
                    None => (0..width).map(|r| rank * width + r).collect(),
                    Some(read) => read.iter().map(|r| rank * width + r).collect(),
                };
                Ok(backend.gather_rows(&ex.out, &own_rows, out)?)
            };
        let rows = PrefillRows {
            ids: &ids,
            positions: &positions,
            stores: &stores,
        };
        // Only the prompt's last row is read after the last layer. With one rank, that row
        // alone runs the last layer's attention and MLP; with several, whose attention is one
        // exchange among them all, the piece that holds it runs the whole last layer.
        let has_last = piece.contains(&last);
        let last_row = [last.saturating_sub(own.start)];
        let read: Option<&[usize]> = match (has_last, ranks) {
            (false, _) => Some(&[]),
            (true, 1) => Some(&last_row),
            (true, _) => None,
        };
        let on_layer = &mut |l| on_pass(j * num_layers + l, passes);
        let x = through_layers(backend, layers, caches, rows, read, attend, on_layer)?;
        if own.contains(&last) {
            // x holds the rows read: the last row alone, or every row of this rank's chunk.
            let row = if read.is_some() { 0 } else { last - own.start };
            logits = layers.logits(backend, &x, &[row])?;
        }
    }
    comm.all_reduce(&mut logits, ReduceOp::Sum)?;
    Ok(logits)
}

/// A piece's buffers for the exchange between ranks, made once a piece: every rank's queries
/// (gathered), their attention output, and the merge of their states.
struct Exchange<B: LayerOps> {
    merge: StatesMerge<B>,
    q: B::Tensor,
    out: B::Tensor,
}

/// The prompt keys a rank holds so far: their physical slots and positions.
#[derive(Default)]
struct HeldKeys {
    slots: Vec<u32>,
    positions: Vec<u32>,
}

impl HeldKeys {
    /// These keys where `kv`, a layer's cache, keeps them.
    fn in_cache<'a, K>(&'a self, kv: &'a K) -> CachedKeys<'a, K> {
        CachedKeys {
            kv,
            slots: &self.slots,
            positions: &self.positions,
        }
    }
}

/// Random keys and values, uniform in ±1, in this rank's slots of the prompt, every layer,
/// `on_layer(layers done)` told after each. Each value depends only on `(seed, layer, K or V,
/// position, element)`, so the context is the same whatever the rank count.
pub(crate) fn fill_random<B: LayerOps>(
    backend: &B,
    layers: &ModelLayers<B>,
    kv: &KvLayout,
    rank: usize,
    seed: u64,
    caches: &mut [B::Kv],
    on_layer: &mut dyn FnMut(usize),
) -> Result<()> {
    let (shape, runs) = (layers.attn_shape(), fill_runs(kv, rank));
    for (l, cache) in caches.iter_mut().enumerate() {
        let layer_seed = seed ^ splitmix64(l as u64);
        backend.fill_kv_random(&shape, cache, layer_seed, &runs)?;
        on_layer(l + 1);
    }
    Ok(())
}

/// This rank's prompt positions as runs of consecutive slots.
fn fill_runs(kv: &KvLayout, rank: usize) -> Vec<FillRun> {
    let mut runs: Vec<FillRun> = Vec::new();
    for positions in kv.prompt_runs(rank) {
        let first = positions.start;
        for (i, slot) in kv.prompt_slots(positions).into_iter().enumerate() {
            let position = (first + i) as u64;
            match runs.last_mut() {
                Some(r)
                    if r.position + r.tokens as u64 == position
                        && r.slot as u64 + r.tokens as u64 == slot as u64 =>
                {
                    r.tokens += 1
                }
                _ => runs.push(FillRun {
                    slot,
                    position,
                    tokens: 1,
                }),
            }
        }
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::*;
    use canopy_comm::ThreadComm;
    use canopy_core::DType;
    use canopy_engine::{Backend, CpuBackend};

    /// Prompts of 7, 1 and 5 tokens in one pass give what each gives alone: the logits of
    /// their last rows and the keys and values stored.
    #[test]
    fn chunks_in_one_pass_give_what_each_gives_alone() {
        let b = &CpuBackend;
        let config = crate::layers::tests::tiny(false);
        let weights = crate::RandomWeights::new(&config, DType::F32, 11);
        let layers = ModelLayers::upload(b, &config, &weights, &mut |_| {}).unwrap();
        let shape = layers.attn_shape();
        let caches = || -> Vec<_> {
            (0..layers.num_layers())
                .map(|_| b.alloc_kv(&shape, DType::F32, 64).unwrap())
                .collect()
        };
        let close = |a: &[f32], b: &[f32]| {
            a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-5)
        };
        let prompts: [&[u32]; 3] = [&[3, 9, 27, 81, 50, 1, 2], &[40], &[5, 6, 7, 8, 90]];
        let firsts = [0u32, 20, 40];
        let run = |prompts: &[(&[u32], u32)], kv: &mut [_]| {
            let (mut ids, mut positions, mut stores, mut chunks, mut last) =
                (vec![], vec![], vec![], vec![], vec![]);
            for &(p, slot) in prompts {
                let first = ids.len();
                ids.extend_from_slice(p);
                positions.extend(0..p.len() as u32);
                stores.extend((0..p.len() as u32).map(|i| ((first as u32 + i), slot + i)));
                chunks.push(first..ids.len());
                last.push(ids.len() - 1);
            }
            let rows = PrefillRows {
                ids: &ids,
                positions: &positions,
                stores: &stores,
            };
            let none: Option<&mut RankAttention<CpuBackend, ThreadComm>> = None;
            let x = prefill_chunks(b, &layers, kv, none, rows, &chunks).unwrap();
            let logits = layers.logits(b, &x, &last).unwrap();
            let vocab = layers.config.vocab_size;
            logits
                .chunks_exact(vocab)
                .map(<[f32]>::to_vec)
                .collect::<Vec<_>>()
        };
        let together: Vec<(&[u32], u32)> = prompts.iter().copied().zip(firsts).collect();
        let mut kv_together = caches();
        let logits = run(&together, &mut kv_together);
        assert_eq!(logits.len(), 3);
        for (i, &(p, slot)) in together.iter().enumerate() {
            let mut kv_alone = caches();
            let alone = run(&[(p, slot)], &mut kv_alone);
            assert!(close(&alone[0], &logits[i]), "prompt {i}'s logits");
            let slots: Vec<u32> = (slot..slot + p.len() as u32).collect();
            for (t, a) in kv_together.iter().zip(&kv_alone) {
                let (kt, vt) = b.load_kv(t, &slots).unwrap();
                let (ka, va) = b.load_kv(a, &slots).unwrap();
                // (The products' sums run in another order at another row count.)
                assert!(
                    close(&kt.data, &ka.data) && close(&vt.data, &va.data),
                    "prompt {i}'s KV"
                );
            }
        }
    }
}
