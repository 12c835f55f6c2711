//! One decode step's forward pass: a batch of rows (one new token each, of any sequences)
//! through every layer, each layer's attention the engine's [`RankAttention`] over the
//! caller's plan of this rank's KV, then the next-token logits.
//!
//! The caller owns the step's bookkeeping: which rows are live, where each new key and value
//! is stored, and the plan that `attention` runs; [`Forward`] owns what a step needs on the
//! backend between calls, so a generation and a serving loop run the same pass.

use crate::layers::ModelLayers;
use crate::Result;
use canopy_engine::{LayerOps, RankAttention, Transport};

/// The rows of one decode step.
#[derive(Debug, Clone, Copy)]
pub struct StepRows<'a> {
    /// Each row's new token.
    pub ids: &'a [u32],
    /// Each row's position in its sequence.
    pub positions: &'a [u32],
    /// `(row, physical slot)` of the rows whose key and value this rank stores.
    pub stores: &'a [(u32, u32)],
}

/// The decode pass of one rank.
pub struct Forward<B: LayerOps> {
    _backend: std::marker::PhantomData<B>,
}

impl<B: LayerOps> Default for Forward<B> {
    fn default() -> Self {
        Self::new()
    }
}

impl<B: LayerOps> Forward<B> {
    pub fn new() -> Forward<B> {
        Forward {
            _backend: std::marker::PhantomData,
        }
    }

    /// `rows` through every layer of `layers`, their keys and values stored in `caches` (one
    /// per layer) and attended by `attention`; returns the rows' logits (`rows × vocab`, on
    /// the host).
    pub fn decode<C: Transport<B>>(
        &mut self,
        backend: &B,
        layers: &ModelLayers<B>,
        caches: &mut [B::Kv],
        attention: &mut RankAttention<B, C>,
        rows: StepRows,
    ) -> Result<Vec<f32>> {
        Ok(self.pass(backend, layers, caches, attention, rows, None)?.0)
    }

    /// [`Forward::decode`], each layer's cross-rank merge timed
    /// ([`RankAttention::attend_timed`], `settle` being the ranks' barrier); returns the
    /// logits and the seconds of every layer's merge together (`None` for the ring).
    pub fn decode_timed<C: Transport<B>>(
        &mut self,
        backend: &B,
        layers: &ModelLayers<B>,
        caches: &mut [B::Kv],
        attention: &mut RankAttention<B, C>,
        rows: StepRows,
        settle: &dyn Fn() -> canopy_engine::Result<()>,
    ) -> Result<(Vec<f32>, Option<f64>)> {
        self.pass(backend, layers, caches, attention, rows, Some(settle))
    }

    fn pass<C: Transport<B>>(
        &mut self,
        backend: &B,
        layers: &ModelLayers<B>,
        caches: &mut [B::Kv],
        attention: &mut RankAttention<B, C>,
        rows: StepRows,
        settle: Option<&dyn Fn() -> canopy_engine::Result<()>>,
    ) -> Result<(Vec<f32>, Option<f64>)> {
        let shape = layers.attn_shape();
        let n = rows.ids.len();
        let mut x = layers.embed(backend, rows.ids)?;
        let mut attn = backend.tensor(n, shape.q_row_elems())?;
        let mut merge_s: Option<f64> = None;
        for (l, cache) in caches.iter_mut().enumerate() {
            let qkv = layers.qkv(backend, l, &x, rows.positions)?;
            backend.store_kv(cache, &qkv.k, &qkv.v, rows.stores)?;
            let q = backend.tensor_queries(&shape, &qkv.q)?;
            let states = match settle {
                None => attention.attend(cache, &q)?,
                Some(settle) => {
                    let (states, seconds) = attention.attend_timed(cache, &q, settle)?;
                    if let Some(s) = seconds {
                        *merge_s.get_or_insert(0.0) += s;
                    }
                    states
                }
            };
            backend.states_output(states, &mut attn)?;
            layers.finish(backend, l, &mut x, &attn)?;
        }
        Ok((layers.logits(backend, &x, 0, n)?, merge_s))
    }
}
