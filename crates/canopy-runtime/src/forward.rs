//! One decode step's forward pass: a batch of rows (one new token each, of any sequences)
//! through every layer, each layer's attention the engine's [`RankAttention`] over the
//! caller's plan of this rank's KV, then the next-token logits.
//!
//! The caller owns the step's bookkeeping: which rows are live, where each new key and value
//! is stored, and the plan that `attention` runs; [`Forward`] owns what a step needs on the
//! backend between calls, so a generation and a serving loop run the same pass.
//!
//! On a backend that records graphs (CUDA), a pass is recorded once its step looks like the
//! last one (same rows, same stores, same epoch of the buffers it reads: no plan, state or
//! input buffer made anew since) and replayed while steps keep looking the same: each step's
//! ids, positions and slots are staged where the recording reads them, and the logits land in
//! one tensor [`Forward`] keeps. A step of several ranks, a timed step, or a backend that
//! records nothing runs op by op, as does every step after a recording failed.

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
    /// Whether passes may be recorded and replayed where the backend records graphs.
    graphs: bool,
    /// The last recorded pass and the step it was recorded for.
    recorded: Option<(PassKey, B::Graph)>,
    /// The last step run op by op: a step like it is recorded.
    last_eager: Option<PassKey>,
    /// Where every pass leaves its logits (`rows × vocab`), kept so a recording's stay valid.
    logits: Option<B::Tensor>,
    replayed: usize,
}

/// What a recorded pass is valid for: every other input is staged or is a buffer of the epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct PassKey {
    epoch: u64,
    rows: usize,
    stores: usize,
}

impl<B: LayerOps> Default for Forward<B> {
    fn default() -> Self {
        Self::new()
    }
}

impl<B: LayerOps> Forward<B> {
    /// A pass that records and replays graphs where it can.
    pub fn new() -> Forward<B> {
        Forward {
            graphs: true,
            recorded: None,
            last_eager: None,
            logits: None,
            replayed: 0,
        }
    }

    /// A pass that runs every step op by op (`false`), or records where it can (`true`).
    pub fn with_graphs(mut self, graphs: bool) -> Forward<B> {
        self.graphs = graphs;
        self
    }

    /// Steps replayed from a recorded pass so far.
    pub fn replayed(&self) -> usize {
        self.replayed
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
        self.keep_logits(backend, layers, rows.ids.len())?;
        let logits = self.logits.as_mut().expect("kept above");
        let recordable = self.graphs && attention.ranks() == 1;
        let Some(key) = recordable
            .then(|| stage(backend, rows))
            .transpose()?
            .flatten()
        else {
            pass(backend, layers, caches, attention, rows, None, logits)?;
            return Ok(backend.download_tensor(logits)?);
        };
        match &self.recorded {
            Some((k, graph)) if *k == key => {
                backend.replay(graph)?;
                self.replayed += 1;
            }
            _ if self.last_eager == Some(key) => {
                backend.begin_capture()?;
                let ran = pass(backend, layers, caches, attention, rows, None, logits);
                match (ran, backend.end_capture()) {
                    (Ok(_), Ok(graph)) => {
                        backend.replay(&graph)?;
                        self.recorded = Some((key, graph));
                    }
                    (ran, ended) => {
                        let why = ran.err().map_or_else(
                            || ended.err().map(|e| e.to_string()).unwrap_or_default(),
                            |e| e.to_string(),
                        );
                        tracing::warn!("decode steps run op by op: recording one failed: {why}");
                        self.graphs = false;
                        self.recorded = None;
                        pass(backend, layers, caches, attention, rows, None, logits)?;
                    }
                }
            }
            _ => {
                self.last_eager = Some(key);
                pass(backend, layers, caches, attention, rows, None, logits)?;
            }
        }
        Ok(backend.download_tensor(logits)?)
    }

    /// [`Forward::decode`], each layer's cross-rank merge timed
    /// ([`RankAttention::attend_timed`], `settle` being the ranks' barrier); returns the
    /// logits and the seconds of every layer's merge together (`None` for the ring). Timed
    /// steps run op by op.
    pub fn decode_timed<C: Transport<B>>(
        &mut self,
        backend: &B,
        layers: &ModelLayers<B>,
        caches: &mut [B::Kv],
        attention: &mut RankAttention<B, C>,
        rows: StepRows,
        settle: &dyn Fn() -> canopy_engine::Result<()>,
    ) -> Result<(Vec<f32>, Option<f64>)> {
        self.keep_logits(backend, layers, rows.ids.len())?;
        let logits = self.logits.as_mut().expect("kept above");
        let merge_s = pass(
            backend,
            layers,
            caches,
            attention,
            rows,
            Some(settle),
            logits,
        )?;
        Ok((backend.download_tensor(logits)?, merge_s))
    }

    /// Keeps a logits tensor for `rows` rows while the rows stay; a new one voids the
    /// recording, which wrote the old one.
    fn keep_logits(&mut self, backend: &B, layers: &ModelLayers<B>, rows: usize) -> Result<()> {
        let vocab = layers.config.vocab_size;
        if self.logits.as_ref().map(|t| backend.dims(t)) != Some((rows, vocab)) {
            self.recorded = None;
            self.last_eager = None;
            self.logits = Some(backend.tensor(rows, vocab)?);
        }
        Ok(())
    }
}

/// Stages the step's inputs where a recorded pass reads them and gives the step's key
/// (`None`: the backend records no graphs).
fn stage<B: LayerOps>(backend: &B, rows: StepRows) -> Result<Option<PassKey>> {
    if backend.graph_epoch().is_none() {
        return Ok(None);
    }
    backend.stage_step(rows.ids, rows.positions, rows.stores)?;
    // Staging may have made a larger input buffer: the epoch is read after it.
    Ok(backend.graph_epoch().map(|epoch| PassKey {
        epoch,
        rows: rows.ids.len(),
        stores: rows.stores.len(),
    }))
}

/// The pass itself, its logits left in `logits`; returns the seconds of the timed merges.
fn pass<B: LayerOps, C: Transport<B>>(
    backend: &B,
    layers: &ModelLayers<B>,
    caches: &mut [B::Kv],
    attention: &mut RankAttention<B, C>,
    rows: StepRows,
    settle: Option<&dyn Fn() -> canopy_engine::Result<()>>,
    logits: &mut B::Tensor,
) -> Result<Option<f64>> {
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
    layers.logits_into(backend, &x, 0, logits)?;
    Ok(merge_s)
}
