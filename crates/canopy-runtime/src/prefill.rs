//! How a prompt's keys and values reach a rank's caches:
//! - the prefill of `generate`: the prompt in pieces ([`KvLayout::pieces`]), each through
//!   every layer, every rank running its chunk of the piece; in the first piece a layer's
//!   keys and values are gathered from every rank and each rank attends its own rows to them;
//!   in a later piece its queries are gathered, each rank attends them to the prompt keys it
//!   holds (read from its cache), and the partial states merge across ranks, each rank
//!   receiving its own rows' (a reduce-scatter, where decode's merge is an all-reduce);
//! - a chunk of a prompt whose earlier tokens are cached already (a shared prefix, earlier
//!   chunks), as a server prefills: each rank runs the chunk's rows whose KV it stores, and
//!   every row attends causally to the chunk's rows and, through the engine's
//!   [`RankAttention`] over a plan of the cached context, to the KV in the paged pools of
//!   every rank;
//! - a random fill that stands in for a prefill when only decode is timed.
//!
//! Each runs its rows through the layers the same way ([`through_layers`]); only how a
//! layer's queries attend differs.

use crate::kv::KvLayout;
use crate::layers::{ModelLayers, Qkv};
use crate::rank::GenerateRequest;
use crate::{Result, RuntimeError};
use canopy_comm::{Collective, ReduceOp};
use canopy_core::data::splitmix64;
use canopy_core::AttnShape;
use canopy_engine::{
    Backend, CachedKeys, FillRun, KeyBlock, LayerOps, RankAttention, StatesMerge, Transport,
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
/// row has one), every row attends to the earlier tokens on every rank. Returns the last
/// layer's hidden rows of the whole pass, the same on every rank.
///
/// On several ranks the pass runs sequence-parallel: each rank runs the rows whose keys and
/// values it stores (`pass.owners`; `rows.stores` are this rank's), so the products, norms
/// and MLPs of a pass are split over the ranks, not repeated on each. At each layer, without
/// a cached context, the ranks gather every row's key and value and each attends its own
/// rows' queries to them; with one, they gather every row's query, each rank attends them
/// all to the chunk keys it holds (its own rows') and to its part of the cached context, and
/// the partial states merge across ranks in a reduce-scatter that leaves each rank its own
/// rows'. Each rank keeps its own rows' output. The last layer's rows are gathered from every
/// rank at the end.
pub(crate) fn prefill_chunks<B: LayerOps, C: Collective + Transport<B>>(
    backend: &B,
    layers: &ModelLayers<B>,
    caches: &mut [B::Kv],
    comm: &C,
    cached: Option<&mut RankAttention<B, C>>,
    pass: ChunkPass,
) -> Result<B::Tensor> {
    if comm.size() > 1 {
        return prefill_split(backend, layers, caches, comm, cached, pass);
    }
    let (mut cached, rows) = (cached, pass.rows);
    let windows = ChunkWindows::new(rows.positions, pass.chunks);
    let shape = layers.attn_shape();
    let n = rows.ids.len();
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

/// A pass of prompt chunks (and maybe decode rows) for [`prefill_chunks`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct ChunkPass<'a> {
    pub rows: PrefillRows<'a>,
    /// Each chunk's rows, a range of the pass's.
    pub chunks: &'a [Range<usize>],
    /// The rank that runs each row: the one that stores its key and value.
    pub owners: &'a [usize],
}

/// A pass's rows split over the ranks that run them.
struct RowSplit {
    /// Each rank's rows, by their place in the pass, in order.
    rows: Vec<Vec<usize>>,
    /// The most rows a rank runs: every rank runs this many, padded, so that each gathers the
    /// same.
    width: usize,
}

impl RowSplit {
    /// Row `i` to rank `owners[i]`.
    fn new(owners: &[usize], ranks: usize) -> Self {
        let mut rows = vec![Vec::new(); ranks];
        for (row, &owner) in owners.iter().enumerate() {
            rows[owner].push(row);
        }
        let width = rows.iter().map(Vec::len).max().unwrap_or(0).max(1);
        RowSplit { rows, width }
    }

    /// Rank `rank`'s rows padded to the width with copies of its first (or the pass's first),
    /// whose outputs are never read.
    fn padded(&self, rank: usize) -> Vec<usize> {
        let mine = &self.rows[rank];
        let pad = mine.first().copied().unwrap_or(0);
        let mut padded = mine.clone();
        padded.resize(self.width, pad);
        padded
    }

    /// Where each row of the pass lands among the rows gathered from every rank (rank-major,
    /// `width` a rank).
    fn gathered_places(&self) -> Vec<usize> {
        let mut places = vec![0; self.rows.iter().map(Vec::len).sum()];
        for (rank, rows) in self.rows.iter().enumerate() {
            for (i, &row) in rows.iter().enumerate() {
                places[row] = rank * self.width + i;
            }
        }
        places
    }
}

/// [`prefill_chunks`] over several ranks, each running the rows it owns.
fn prefill_split<B: LayerOps, C: Collective + Transport<B>>(
    backend: &B,
    layers: &ModelLayers<B>,
    caches: &mut [B::Kv],
    comm: &C,
    mut cached: Option<&mut RankAttention<B, C>>,
    pass: ChunkPass,
) -> Result<B::Tensor> {
    let (rank, ranks) = (comm.rank(), comm.size());
    let rows = pass.rows;
    let highest = pass.owners.iter().max().copied().unwrap_or(0);
    if pass.owners.len() != rows.ids.len() || highest >= ranks {
        return Err(RuntimeError::Protocol(format!(
            "a prefill pass of {} rows on {ranks} ranks got {} owners, up to rank {highest}",
            rows.ids.len(),
            pass.owners.len(),
        )));
    }
    let split = RowSplit::new(pass.owners, ranks);
    let windows = ChunkWindows::new(rows.positions, pass.chunks);
    let shape = layers.attn_shape();
    let (n, width, cols) = (rows.ids.len(), split.width, shape.q_row_elems());
    let mine = split.padded(rank);
    let ids: Vec<u32> = mine.iter().map(|&r| rows.ids[r]).collect();
    let positions: Vec<u32> = mine.iter().map(|&r| rows.positions[r]).collect();
    let local = |row: u32| split.rows[rank].binary_search(&(row as usize)).ok();
    let stores = (rows.stores.iter())
        .map(|&(row, slot)| {
            local(row).map(|i| (i as u32, slot)).ok_or_else(|| {
                RuntimeError::Protocol(format!(
                    "rank {rank} stores row {row} of a prefill pass that another rank runs"
                ))
            })
        })
        .collect::<Result<Vec<_>>>()?;
    // The rows' keys at their places among the pass's keys; the padding's are past every
    // query's.
    let key_places = |rank: usize| {
        let rows = &split.rows[rank];
        (0..width).map(|i| rows.get(i).map_or(u32::MAX, |&r| windows.k_pos[r]))
    };
    let k_pos: Vec<u32> = key_places(rank).collect();
    let kv_cols = shape.kv_token_elems();
    let mut exchange: Exchange<B> = match cached.is_some() {
        // Every row's query comes to every rank, which attends them all to its own rows' keys
        // and its part of the cached context; the states merge across ranks, each rank
        // receiving its own rows'.
        true => Exchange::Queries {
            q: backend.output_tensor(ranks * width, cols)?,
            merge: StatesMerge::new(
                backend,
                ranks * width * shape.q_heads,
                shape.head_dim,
                ranks,
            )?,
        },
        // Every row's key and value comes to every rank, which attends its own rows' queries
        // to them: nothing to merge.
        false => Exchange::Keys {
            k: backend.output_tensor(ranks * width, kv_cols)?,
            v: backend.output_tensor(ranks * width, kv_cols)?,
        },
    };
    let every_k_pos: Vec<u32> = (0..ranks).flat_map(key_places).collect();
    let own_q_pos: Vec<u32> = mine.iter().map(|&r| windows.q_pos[r]).collect();
    let own_q_from: Option<Vec<u32>> =
        (windows.q_from.as_ref()).map(|from| mine.iter().map(|&r| from[r]).collect());
    let places = split.gathered_places();
    let blocked_rows: Vec<usize> = (0..ranks).flat_map(|r| split.padded(r)).collect();
    let own_block: Vec<usize> = (rank * width..(rank + 1) * width).collect();
    let attend = &mut |cache: &B::Kv, qkv: Qkv<B>, _: Option<&[usize]>, out: &mut B::Tensor| {
        let dtype = backend.kv_dtype(cache);
        let (cached, q, merge) = match (&mut exchange, cached.as_deref_mut()) {
            (Exchange::Queries { q, merge }, Some(cached)) => (cached, q, merge),
            (Exchange::Keys { k, v }, _) => {
                all_gather_rows(backend, comm, &qkv.k, width, k)?;
                all_gather_rows(backend, comm, &qkv.v, width, v)?;
                let every = KeyBlock {
                    k,
                    v,
                    positions: &every_k_pos,
                    dtype,
                };
                let mut states = backend.empty_states(&shape, width)?;
                let (q_pos, from) = (&own_q_pos, own_q_from.as_deref());
                backend.causal_attention_from(&shape, &qkv.q, q_pos, from, every, &mut states)?;
                return Ok(backend.states_output(&states, out)?);
            }
            (Exchange::Queries { .. }, None) => {
                return Err(RuntimeError::Protocol(
                    "a prefill pass lost its cached context between layers".into(),
                ))
            }
        };
        all_gather_rows(backend, comm, &qkv.q, width, q)?;
        let mut pass_q = backend.output_tensor(n, cols)?;
        backend.gather_rows(q, &places, &mut pass_q)?;
        let mut states = backend.empty_states(&shape, n)?;
        let own = KeyBlock {
            k: &qkv.k,
            v: &qkv.v,
            positions: &k_pos,
            dtype,
        };
        let (q_pos, q_from) = (&windows.q_pos, windows.q_from.as_deref());
        backend.causal_attention_from(&shape, &pass_q, q_pos, q_from, own, &mut states)?;
        let pass_q = backend.take_queries(&shape, pass_q)?;
        let local = cached.attend_local(cache, &pass_q, &states)?;
        // Each rank's rows in a block of its own, as the queries were gathered (every row
        // written: no fill first).
        let mut blocked = backend.alloc_states(&shape, ranks * width)?;
        backend.gather_states(local, &blocked_rows, &mut blocked)?;
        merge.run_scattered(backend, comm, &mut blocked)?;
        own_states_output(backend, &shape, &blocked, &own_block, out)
    };
    let own_rows = PrefillRows {
        ids: &ids,
        positions: &positions,
        stores: &stores,
    };
    let x = through_layers(backend, layers, caches, own_rows, None, attend, &mut |_| {})?;
    let hidden = backend.dims(&x).1;
    let mut every = backend.output_tensor(ranks * width, hidden)?;
    all_gather_rows(backend, comm, &x, width, &mut every)?;
    let mut pass = backend.output_tensor(n, hidden)?;
    backend.gather_rows(&every, &places, &mut pass)?;
    Ok(pass)
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
/// each layer of the first piece, every rank attends its own rows to the piece's gathered
/// keys and values (the padding's keys at a position past every query's). At each layer of a
/// later piece, every rank attends the piece's gathered queries to the prompt keys it holds so
/// far, its chunks of this piece and the earlier ones, where its cache keeps them (a query
/// sees the keys at or before its position); the partial states merge across ranks in a
/// reduce-scatter ([`StatesMerge::run_scattered`]), which leaves each rank its own rows'. A
/// rank's attention work is its share of the keys, and the activations are bounded by the
/// piece, not the prompt.
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
    let last = req.prompt.len() - 1;
    let mut logits = vec![0.0; layers.config.vocab_size];
    let mut held = HeldKeys::default();
    for (j, piece) in kv.pieces().iter().enumerate() {
        let chunks = kv.chunks(piece);
        let width = chunks.iter().map(Vec::len).max().unwrap_or(0).max(1);
        let padded = |c: &[usize]| {
            let mut rows = c.to_vec();
            rows.resize(width, piece.end - 1);
            rows
        };
        let own = &chunks[rank];
        let own_padded = padded(own);
        let ids: Vec<u32> = own_padded.iter().map(|&p| req.prompt[p]).collect();
        let positions: Vec<u32> = own_padded.iter().map(|&p| p as u32).collect();
        let own_slots = kv.prompt_slots(own.iter().copied());
        let stores: Vec<(u32, u32)> = own_slots
            .iter()
            .enumerate()
            .map(|(row, &slot)| (row as u32, slot))
            .collect();
        held.slots.extend(&own_slots);
        held.positions.extend(own.iter().map(|&p| p as u32));
        let gathered: Vec<u32> = (chunks.iter())
            .flat_map(|c| padded(c))
            .map(|p| p as u32)
            .collect();
        let (cols, kv_cols) = (shape.q_row_elems(), shape.kv_token_elems());
        let mut exchange: Option<Exchange<B>> = match (ranks, j) {
            (1, _) => None,
            (_, 0) => Some(Exchange::Keys {
                k: backend.output_tensor(gathered.len(), kv_cols)?,
                v: backend.output_tensor(gathered.len(), kv_cols)?,
            }),
            _ => Some(Exchange::Queries {
                q: backend.tensor(gathered.len(), cols)?,
                merge: StatesMerge::new(
                    backend,
                    gathered.len() * shape.q_heads,
                    shape.head_dim,
                    ranks,
                )?,
            }),
        };
        // The piece's keys as gathered; the padding's are past every query's.
        let gathered_keys: Vec<u32> = (chunks.iter())
            .flat_map(|c| {
                let pad = std::iter::repeat_n(u32::MAX, width - c.len());
                c.iter().map(|&p| p as u32).chain(pad)
            })
            .collect();
        let held = &held;
        let attend =
            &mut |cache: &B::Kv, qkv: Qkv<B>, read: Option<&[usize]>, out: &mut B::Tensor| {
                // This rank's rows that are read, and their positions.
                let (picked, q_pos): (_, Cow<[u32]>) = match read {
                    None => (None, Cow::Borrowed(&positions)),
                    Some(read) => {
                        let mut q = backend.output_tensor(read.len(), cols)?;
                        backend.gather_rows(&qkv.q, read, &mut q)?;
                        (Some(q), read.iter().map(|&r| positions[r]).collect())
                    }
                };
                let q = picked.as_ref().unwrap_or(&qkv.q);
                match exchange.as_mut() {
                    None => {
                        let keys = held.in_cache(cache);
                        Ok(backend.cached_attention_output(&shape, q, &q_pos, keys, out)?)
                    }
                    Some(Exchange::Keys { k, v }) => {
                        all_gather_rows(backend, comm, &qkv.k, width, k)?;
                        all_gather_rows(backend, comm, &qkv.v, width, v)?;
                        let every = KeyBlock {
                            k,
                            v,
                            positions: &gathered_keys,
                            dtype: backend.kv_dtype(cache),
                        };
                        let mut states = backend.empty_states(&shape, q_pos.len())?;
                        backend.causal_attention(&shape, q, &q_pos, every, &mut states)?;
                        Ok(backend.states_output(&states, out)?)
                    }
                    Some(Exchange::Queries { q, merge }) => {
                        all_gather_rows(backend, comm, &qkv.q, width, q)?;
                        let mut states = backend.empty_states(&shape, gathered.len())?;
                        let keys = held.in_cache(cache);
                        backend.cached_attention(&shape, q, &gathered, keys, &mut states)?;
                        // The gathered rows are rank-major: each rank reads its own block.
                        merge.run_scattered(backend, comm, &mut states)?;
                        let own_rows: Vec<usize> = match read {
                            None => (0..width).map(|r| rank * width + r).collect(),
                            Some(read) => read.iter().map(|r| rank * width + r).collect(),
                        };
                        own_states_output(backend, &shape, &states, &own_rows, out)
                    }
                }
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
        let own_last = own.iter().position(|&p| p == last);
        let last_row = [own_last.unwrap_or(0)];
        let read: Option<&[usize]> = match (has_last, ranks) {
            (false, _) => Some(&[]),
            (true, 1) => Some(&last_row),
            (true, _) => None,
        };
        let on_layer = &mut |l| on_pass(j * num_layers + l, passes);
        let x = through_layers(backend, layers, caches, rows, read, attend, on_layer)?;
        if let Some(own_last) = own_last {
            // x holds the rows read: the last row alone, or every row of this rank's chunk.
            let row = if read.is_some() { 0 } else { own_last };
            logits = layers.logits(backend, &x, &[row])?;
        }
    }
    comm.all_reduce(&mut logits, ReduceOp::Sum)?;
    Ok(logits)
}

/// The buffers of a prefill pass's exchange between ranks, made once a pass.
enum Exchange<B: LayerOps> {
    /// Every rank's keys and values (gathered), to which each rank attends its own rows: a
    /// pass whose queries see no keys the ranks held before it.
    Keys { k: B::Tensor, v: B::Tensor },
    /// Every rank's queries (gathered) and the merge of their states: a pass whose queries
    /// also see keys each rank held before it, whose states merge across ranks, each rank
    /// receiving its own rows' ([`StatesMerge::run_scattered`]).
    Queries { q: B::Tensor, merge: StatesMerge<B> },
}

/// Rows `rows` of `states` as attention output (`out`, `rows.len()` rows).
fn own_states_output<B: LayerOps>(
    backend: &B,
    shape: &AttnShape,
    states: &B::States,
    rows: &[usize],
    out: &mut B::Tensor,
) -> Result<()> {
    let mut own = backend.alloc_states(shape, rows.len())?;
    backend.gather_states(states, rows, &mut own)?;
    Ok(backend.states_output(&own, out)?)
}

/// Every rank's `rows` rows of `mine` into `every`, in rank order.
fn all_gather_rows<B: LayerOps, C: Transport<B>>(
    backend: &B,
    comm: &C,
    mine: &B::Tensor,
    rows: usize,
    every: &mut B::Tensor,
) -> Result<()> {
    let cols = backend.dims(mine).1;
    let every = backend.tensor_buf_mut(every);
    Ok(comm.all_gather_buf(backend, backend.tensor_buf(mine), rows * cols, every)?)
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
    use canopy_comm::{Group, ThreadComm, ThreadWorld};
    use canopy_core::DType;
    use canopy_engine::{Backend, CpuBackend};
    use std::time::Duration;

    /// Prompts of 7, 1 and 5 tokens in one pass give what each gives alone on one rank: the
    /// logits of their last rows and the keys and values stored, whether the pass runs on one
    /// rank or is split, two rows at a time in turn, over two or three; each prompt alone
    /// split so gives the same logits.
    #[test]
    fn chunks_in_one_pass_give_what_each_gives_alone() {
        let b = &CpuBackend;
        let config = crate::layers::tests::tiny(false);
        let weights = crate::RandomWeights::new(&config, DType::F32, 11);
        let layers = ModelLayers::upload(b, &config, &weights, &mut |_| {}).unwrap();
        let shape = layers.attn_shape();
        let close = |a: &[f32], b: &[f32]| {
            a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-5)
        };
        let prompts: [&[u32]; 3] = [&[3, 9, 27, 81, 50, 1, 2], &[40], &[5, 6, 7, 8, 90]];
        let firsts = [0u32, 20, 40];
        let owner = |row: usize, ranks: usize| row / 2 % ranks;
        // Rank 0's logits of each prompt's last row, and each rank's caches.
        let run = |prompts: &[(&[u32], u32)], ranks: usize| {
            let (mut ids, mut positions, mut slots, mut chunks, mut last) =
                (vec![], vec![], vec![], vec![], vec![]);
            for &(p, slot) in prompts {
                let first = ids.len();
                ids.extend_from_slice(p);
                positions.extend(0..p.len() as u32);
                slots.extend(slot..slot + p.len() as u32);
                chunks.push(first..ids.len());
                last.push(ids.len() - 1);
            }
            let owners: Vec<usize> = (0..ids.len()).map(|r| owner(r, ranks)).collect();
            let per_rank = ThreadWorld::run(ranks, Duration::from_secs(60), |comm| {
                let rank = comm.rank();
                let stores: Vec<(u32, u32)> = (slots.iter().enumerate())
                    .filter(|&(row, _)| owners[row] == rank)
                    .map(|(row, &slot)| (row as u32, slot))
                    .collect();
                let pass = ChunkPass {
                    rows: PrefillRows {
                        ids: &ids,
                        positions: &positions,
                        stores: &stores,
                    },
                    chunks: &chunks,
                    owners: &owners,
                };
                let mut kv: Vec<_> = (0..layers.num_layers())
                    .map(|_| b.alloc_kv(&shape, DType::F32, 64))
                    .collect::<canopy_engine::Result<_>>()?;
                let none: Option<&mut RankAttention<CpuBackend, ThreadComm>> = None;
                let x = prefill_chunks(b, &layers, &mut kv, &comm, none, pass)?;
                Ok::<_, crate::RuntimeError>((layers.logits(b, &x, &last)?, kv))
            });
            let per_rank: Vec<_> = per_rank.into_iter().map(Result::unwrap).collect();
            let vocab = layers.config.vocab_size;
            let logits: Vec<Vec<f32>> = (per_rank[0].0.chunks_exact(vocab))
                .map(<[f32]>::to_vec)
                .collect();
            for (r, (other, _)) in per_rank.iter().enumerate() {
                assert_eq!(other, &per_rank[0].0, "rank {r}'s logits against rank 0's");
            }
            let caches: Vec<Vec<_>> = per_rank.into_iter().map(|(_, kv)| kv).collect();
            (logits, caches, owners)
        };
        let together: Vec<(&[u32], u32)> = prompts.iter().copied().zip(firsts).collect();
        for ranks in [1, 2, 3] {
            let (logits, kv_together, owners) = run(&together, ranks);
            assert_eq!(logits.len(), 3);
            let mut first_row = 0;
            for (i, &(p, slot)) in together.iter().enumerate() {
                let (alone, kv_alone, _) = run(&[(p, slot)], 1);
                let what = format!("prompt {i} on {ranks} ranks");
                assert!(close(&alone[0], &logits[i]), "{what}: logits");
                let (split, _, _) = run(&[(p, slot)], ranks);
                assert!(close(&alone[0], &split[0]), "{what}, alone: logits");
                for t in 0..p.len() {
                    let (row, at) = (first_row + t, [slot + t as u32]);
                    let held = &kv_together[owners[row]];
                    for (l, (split, one)) in held.iter().zip(&kv_alone[0]).enumerate() {
                        let (kt, vt) = b.load_kv(split, &at).unwrap();
                        let (ka, va) = b.load_kv(one, &at).unwrap();
                        // (The products' sums run in another order at another row count.)
                        assert!(
                            close(&kt.data, &ka.data) && close(&vt.data, &va.data),
                            "{what}: token {t}'s KV at layer {l}"
                        );
                    }
                }
                first_row += p.len();
            }
        }
    }
}
