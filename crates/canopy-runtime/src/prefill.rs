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
    Backend, FillRun, KeyBlock, LayerOps, MergeCollective, NodeLayout, RankAttention, StatesMerge,
    Transport,
};
use std::ops::Range;

/// The rows of one prefill pass.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PrefillRows<'a> {
    pub ids: &'a [u32],
    pub positions: &'a [u32],
    /// `(row, physical slot)` of the rows whose key and value this rank stores.
    pub stores: &'a [(u32, u32)],
}

/// How one layer's queries attend, given the layer's cache and its q, k and v: writes the
/// rows' attention output (`rows × q_heads · head_dim`) into the last argument.
type Attend<'a, B> =
    dyn FnMut(&<B as Backend>::Kv, &Qkv<B>, &mut <B as LayerOps>::Tensor) -> Result<()> + 'a;

/// `rows` through every layer, each row's key and value stored in `caches` (one per layer),
/// each layer's queries attending by `attend(layer's cache, its q, k, v, output)`, and
/// `on_layer(layers done)` told after each; returns the last layer's hidden rows.
fn through_layers<B: LayerOps>(
    backend: &B,
    layers: &ModelLayers<B>,
    caches: &mut [B::Kv],
    rows: PrefillRows,
    attend: &mut Attend<B>,
    on_layer: &mut dyn FnMut(usize),
) -> Result<B::Tensor> {
    let mut x = layers.embed(backend, rows.ids)?;
    let mut attn = layers.attention_output(backend, rows.ids.len())?;
    for (l, cache) in caches.iter_mut().enumerate() {
        let qkv = layers.qkv(backend, l, &x, rows.positions, Some((cache, rows.stores)))?;
        attend(cache, &qkv, &mut attn)?;
        layers.finish(backend, l, &mut x, &attn)?;
        on_layer(l + 1);
    }
    Ok(x)
}

/// A chunk of a prompt whose earlier tokens are in the caches: `rows` attend causally to one
/// another and, through `cached` (a plan whose queries are the chunk's rows on the node that
/// ends the cached context; `None` when nothing is cached), to every earlier token on every
/// rank. Every rank runs every row and gets the same result; returns the last row's logits.
pub(crate) fn prefill_chunk<B: LayerOps, C: Transport<B>>(
    backend: &B,
    layers: &ModelLayers<B>,
    caches: &mut [B::Kv],
    mut cached: Option<&mut RankAttention<B, C>>,
    rows: PrefillRows,
) -> Result<Vec<f32>> {
    let shape = layers.attn_shape();
    let attend = &mut |cache: &B::Kv, qkv: &Qkv<B>, out: &mut B::Tensor| {
        let mut states = backend.empty_states(&shape, rows.ids.len())?;
        let own = KeyBlock {
            k: &qkv.k,
            v: &qkv.v,
            positions: rows.positions,
            dtype: backend.kv_dtype(cache),
        };
        backend.causal_attention(&shape, &qkv.q, rows.positions, own, &mut states)?;
        if let Some(cached) = cached.as_deref_mut() {
            let q = backend.tensor_queries(&shape, &qkv.q)?;
            backend.merge_into(&mut states, cached.attend(cache, &q)?)?;
        }
        Ok(backend.states_output(&states, out)?)
    };
    let x = through_layers(backend, layers, caches, rows, attend, &mut |_| {})?;
    layers.logits(backend, &x, rows.ids.len() - 1, 1)
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
        let attend = &mut |cache: &B::Kv, qkv: &Qkv<B>, out: &mut B::Tensor| {
            let Some(ex) = exchange.as_mut() else {
                let mut states = backend.empty_states(&shape, width)?;
                backend.cached_attention(
                    &shape,
                    &qkv.q,
                    &positions,
                    cache,
                    &held.slots,
                    &held.positions,
                    &mut states,
                )?;
                return Ok(backend.states_output(&states, out)?);
            };
            let mine = backend.tensor_buf(&qkv.q);
            comm.all_gather_buf(
                backend,
                mine,
                width * cols,
                backend.tensor_buf_mut(&mut ex.q),
            )?;
            let mut states = backend.empty_states(&shape, gathered.len())?;
            backend.cached_attention(
                &shape,
                &ex.q,
                &gathered,
                cache,
                &held.slots,
                &held.positions,
                &mut states,
            )?;
            let how = MergeCollective::Allreduce2;
            ex.merge.run(backend, comm, &mut states, how, &layout)?;
            backend.states_output(&states, &mut ex.out)?;
            Ok(backend.copy_rows(&ex.out, rank * width, out)?)
        };
        let rows = PrefillRows {
            ids: &ids,
            positions: &positions,
            stores: &stores,
        };
        let on_layer = &mut |l| on_pass(j * num_layers + l, passes);
        let x = through_layers(backend, layers, caches, rows, attend, on_layer)?;
        if own.contains(&last) {
            logits = layers.logits(backend, &x, last - own.start, 1)?;
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
