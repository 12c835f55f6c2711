//! How a prompt's keys and values reach a rank's caches:
//! - the sequence-parallel prefill of `generate` (the prompt through every layer, chunks
//!   passed around the ring for causal attention);
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
use canopy_core::data::{hash_uniform, splitmix64, KV_AMPLITUDE, STREAM_K, STREAM_V};
use canopy_core::{AttnShape, DType};
use canopy_engine::{KeyBlock, LayerOps, RankAttention, Transport};
use rayon::prelude::*;

/// The rows of one prefill pass.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PrefillRows<'a> {
    pub ids: &'a [u32],
    pub positions: &'a [u32],
    /// `(row, physical slot)` of the rows whose key and value this rank stores.
    pub stores: &'a [(u32, u32)],
}

/// How one layer's queries attend, given the layer's cache and its q, k and v.
type Attend<'a, B> = dyn FnMut(
        &<B as canopy_engine::Backend>::Kv,
        &Qkv<B>,
    ) -> Result<<B as canopy_engine::Backend>::States>
    + 'a;

/// `rows` through every layer, each row's key and value stored in `caches` (one per layer),
/// each layer's queries attending by `attend(layer's cache, its q, k, v)`, and
/// `on_layer(layers done)` told after each; returns the last layer's hidden rows.
fn through_layers<B: LayerOps>(
    backend: &B,
    layers: &ModelLayers<B>,
    caches: &mut [B::Kv],
    rows: PrefillRows,
    attend: &mut Attend<B>,
    on_layer: &mut dyn FnMut(usize),
) -> Result<B::Tensor> {
    let shape = layers.attn_shape();
    let mut x = layers.embed(backend, rows.ids)?;
    let mut attn = backend.tensor(rows.ids.len(), shape.q_row_elems())?;
    for (l, cache) in caches.iter_mut().enumerate() {
        let qkv = layers.qkv(backend, l, &x, rows.positions)?;
        backend.store_kv(cache, &qkv.k, &qkv.v, rows.stores)?;
        let states = attend(cache, &qkv)?;
        backend.states_output(&states, &mut attn)?;
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
    let attend = &mut |cache: &B::Kv, qkv: &Qkv<B>| {
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
        Ok(states)
    };
    let x = through_layers(backend, layers, caches, rows, attend, &mut |_| {})?;
    layers.logits(backend, &x, rows.ids.len() - 1, 1)
}

/// This rank's chunk of the prompt through every layer, its keys and values stored in
/// `caches`, `on_layer(layers done)` told after each; returns the first token's logits (the
/// same on every rank).
pub(crate) fn prefill<B: LayerOps, C: Collective + Transport<B>>(
    backend: &B,
    layers: &ModelLayers<B>,
    req: &GenerateRequest,
    comm: &C,
    kv: &KvLayout,
    caches: &mut [B::Kv],
    on_layer: &mut dyn FnMut(usize),
) -> Result<Vec<f32>> {
    let (rank, ranks) = (comm.rank(), comm.size());
    let shape = layers.attn_shape();
    let chunk = kv.prompt_chunk(rank);
    let positions: Vec<u32> = chunk.clone().map(|p| p as u32).collect();
    let rows = PrefillRows {
        ids: &req.prompt[chunk.clone()],
        positions: &positions,
        stores: &kv.prompt_slots(rank),
    };
    let attend = &mut |cache: &B::Kv, qkv: &Qkv<B>| {
        let dtype = backend.kv_dtype(cache);
        prefill_attention(backend, &shape, comm, qkv, &positions, dtype)
    };
    let x = through_layers(backend, layers, caches, rows, attend, on_layer)?;
    // The prompt's last token is the last row of the last non-empty chunk.
    let last_rank = (0..ranks)
        .rev()
        .find(|&r| !kv.prompt_chunk(r).is_empty())
        .expect("a non-empty prompt has a chunk");
    let mut logits = if rank == last_rank {
        layers.logits(backend, &x, chunk.len() - 1, 1)?
    } else {
        vec![0.0; layers.config.vocab_size]
    };
    comm.all_reduce(&mut logits, ReduceOp::Sum)?;
    Ok(logits)
}

/// Causal attention of this rank's chunk over the whole prompt so far: its own chunk, then
/// every other chunk passed around the ring (through the host: a chunk's keys, values and
/// positions), the keys read as a cache of `dtype` holds them.
fn prefill_attention<B: LayerOps, C: Collective + Transport<B>>(
    backend: &B,
    shape: &AttnShape,
    comm: &C,
    qkv: &Qkv<B>,
    positions: &[u32],
    dtype: DType,
) -> Result<B::States> {
    let mut states = backend.empty_states(shape, positions.len())?;
    let own = KeyBlock {
        k: &qkv.k,
        v: &qkv.v,
        positions,
        dtype,
    };
    backend.causal_attention(shape, &qkv.q, positions, own, &mut states)?;
    let (rank, p) = (comm.rank(), comm.size());
    if p == 1 {
        return Ok(states);
    }
    let (next, prev) = ((rank + 1) % p, (rank + p - 1) % p);
    let per = shape.kv_token_elems();
    let (mut k, mut v, mut pos) = (
        backend.download_tensor(&qkv.k)?,
        backend.download_tensor(&qkv.v)?,
        positions.to_vec(),
    );
    for _ in 1..p {
        // The block's length first, so the receiver can size its buffers.
        let len = (pos.len() as u32).to_le_bytes();
        let mut theirs = [0u8; 4];
        comm.send(&len, next)?;
        comm.recv(&mut theirs, prev)?;
        let n = u32::from_le_bytes(theirs) as usize;
        let (mut k2, mut v2, mut pos2) =
            (vec![0.0f32; n * per], vec![0.0f32; n * per], vec![0u32; n]);
        comm.send(&k, next)?;
        comm.recv(&mut k2, prev)?;
        comm.send(&v, next)?;
        comm.recv(&mut v2, prev)?;
        comm.send(bytemuck::cast_slice::<u32, u8>(&pos), next)?;
        comm.recv(bytemuck::cast_slice_mut::<u32, u8>(&mut pos2), prev)?;
        (k, v, pos) = (k2, v2, pos2);
        if n > 0 {
            let kt = backend.upload_tensor(&k, n, per)?;
            let vt = backend.upload_tensor(&v, n, per)?;
            let theirs = KeyBlock {
                k: &kt,
                v: &vt,
                positions: &pos,
                dtype,
            };
            backend.causal_attention(shape, &qkv.q, positions, theirs, &mut states)?;
        }
    }
    Ok(states)
}

/// Rows of random keys and values stored per upload: bounds the host memory of a fill.
const FILL_ROWS: usize = 8192;

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
    let width = layers.attn_shape().kv_token_elems();
    let chunk = kv.prompt_chunk(rank);
    let slots = kv.prompt_slots(rank);
    for (l, cache) in caches.iter_mut().enumerate() {
        for (piece, at) in slots.chunks(FILL_ROWS).zip((0..).step_by(FILL_ROWS)) {
            let first = (chunk.start + at) as u64;
            let layer_seed = seed ^ splitmix64(l as u64);
            let draw = |stream| {
                random_values(
                    layer_seed,
                    stream,
                    first * width as u64,
                    piece.len() * width,
                )
            };
            let k = backend.upload_tensor(&draw(STREAM_K), piece.len(), width)?;
            let v = backend.upload_tensor(&draw(STREAM_V), piece.len(), width)?;
            let rows: Vec<(u32, u32)> = piece
                .iter()
                .enumerate()
                .map(|(i, &(_, slot))| (i as u32, slot))
                .collect();
            backend.store_kv(cache, &k, &v, &rows)?;
        }
        on_layer(l + 1);
    }
    Ok(())
}

/// `n` values uniform in ±1: element `i` of `stream` is the hashed value at `first + i`
/// (`canopy_core::data`, as the attention benchmarks draw their KV).
fn random_values(seed: u64, stream: u32, first: u64, n: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; n];
    out.par_iter_mut().enumerate().for_each(|(i, x)| {
        *x = hash_uniform(seed, stream, first + i as u64, KV_AMPLITUDE);
    });
    out
}

#[cfg(test)]
mod tests {
    use super::random_values;
    use canopy_core::data::STREAM_K;

    #[test]
    fn random_values_are_spread_and_depend_on_position_only() {
        let a = random_values(7, STREAM_K, 100, 5000);
        assert!(a.iter().all(|x| (-1.0..1.0).contains(x)));
        let mean = a.iter().sum::<f32>() / a.len() as f32;
        assert!(mean.abs() < 0.05, "mean {mean}");
        // The same positions drawn from another starting point give the same values.
        assert_eq!(random_values(7, STREAM_K, 1100, 10), a[1000..1010]);
        assert_ne!(random_values(8, STREAM_K, 100, 10), a[..10]);
    }
}
