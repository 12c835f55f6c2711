//! One decode step's forward pass: a batch of rows (one new token each, of any sequences)
//! through every layer, each layer's attention the engine's [`RankAttention`] over the
//! caller's plan of this rank's KV, then the next-token logits.
//!
//! The caller owns the step's bookkeeping: which rows are live, where each new key and value
//! is stored, and the plan that `attention` runs; [`Forward`] owns what a step needs on the
//! backend between calls, so a generation and a serving loop run the same pass.
//!
//! On a backend that records graphs (CUDA), a pass is recorded once its step looks like the
//! last ones (same rows, same stores, same epoch of the buffers it reads: no plan, state or
//! input buffer made anew since) and replayed while steps keep looking the same: each step's
//! ids, positions and slots are staged where the recording reads them, and the logits land in
//! tensors [`Forward`] keeps for the step's shape. The last few shapes keep their tensors and
//! recordings (`recorder`), so steps that move between a few batch sizes replay each. A step
//! of several ranks is recorded where its merge stays on the backend's stream (the tree over
//! NCCL: the merge's collectives are nodes of the graph); a ring step of several ranks, a
//! merge through the host, a timed step, or a backend that records nothing runs op by op, as
//! does every step after a recording failed.
//!
//! A step whose draws reach only each row's most likely tokens (greedy, or cut by `top_k`)
//! narrows its logits to them on the backend, inside the pass and its recording
//! ([`LayerOps::top_logits`]); the host then reads `2k` numbers a row, not the vocabulary.
//! Rows whose draws need more are read further after the pass, as `generate` and the server
//! both ask (`RowReads`): whole, reduced for log-probabilities, or to their softmax totals.

use crate::layers::ModelLayers;
use crate::sampling::{RowTerms, StepLogits, LOGPROBS_MAX};
use crate::Result;
use canopy_core::logits::TailWalk;
use canopy_engine::{LayerOps, RankAttention, Transport};
use recorder::{PassKey, PassShape, Recorder, Vote};

pub(crate) use recorder::Kept;
use std::collections::BTreeMap;

pub(crate) use recorder::KEPT_PASSES;

mod recorder;

/// The rows of one decode step.
#[derive(Debug, Clone, Copy)]
pub struct StepRows<'a> {
    /// Each row's new token.
    pub ids: &'a [u32],
    /// Each row's position in its sequence.
    pub positions: &'a [u32],
    /// `(row, physical slot)` of the rows whose key and value this rank stores.
    pub stores: &'a [(u32, u32)],
    /// How many of each row's most likely tokens the step returns, narrowed on the backend
    /// (`None`: whole rows of logits).
    pub reach: Option<usize>,
}

/// The decode pass of one rank.
pub struct Forward<B: LayerOps> {
    /// Whether passes may be recorded and replayed where the backend records graphs.
    graphs: bool,
    recorder: Recorder<B::Graph>,
    /// Where the passes of the last few step shapes leave their logits, the current shape
    /// last: kept so that each shape's recording stays valid.
    kept: Kept<PassShape, KeptLogits<B::Tensor>>,
}

/// Where every pass of one shape leaves its logits.
struct KeptLogits<T> {
    /// `rows × vocab`.
    logits: T,
    /// Each row narrowed to its most likely tokens (`rows × 2k`).
    top: Option<T>,
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
            recorder: Recorder::new(),
            kept: Kept::new(),
        }
    }

    /// A pass that runs every step op by op (`false`), or records where it can (`true`).
    pub fn with_graphs(mut self, graphs: bool) -> Forward<B> {
        self.graphs = graphs;
        self
    }

    /// Steps replayed from a recorded pass so far.
    pub fn replayed(&self) -> usize {
        self.recorder.replayed()
    }

    /// `rows` through every layer of `layers`, their keys and values stored in `caches` (one
    /// per layer) and attended by `attention`; returns the rows' logits on the host, each row
    /// narrowed to its [`StepRows::reach`] most likely tokens. `meanwhile` runs on the host
    /// once the pass is launched, while a device runs it, with the pass's logits (`rows ×
    /// vocab`) to queue more work behind it.
    pub fn decode<C: Transport<B>>(
        &mut self,
        backend: &B,
        layers: &ModelLayers<B>,
        caches: &mut [B::Kv],
        attention: &mut RankAttention<B, C>,
        rows: StepRows,
        meanwhile: &mut dyn FnMut(&B::Tensor) -> Result<()>,
    ) -> Result<StepLogits> {
        let began = std::time::Instant::now();
        let shape = self.keep_logits(backend, layers, rows.ids.len(), rows.reach)?;
        self.step(backend, layers, caches, attention, rows, shape)?;
        let launched = std::time::Instant::now();
        meanwhile(&self.current().logits)?;
        let logits = self.download(backend, layers);
        tracing::debug!(
            launch_ms = crate::rank::ms(launched - began),
            download_ms = crate::rank::ms(launched.elapsed()),
            "decode pass"
        );
        logits
    }

    /// The last pass's logits on the device (`rows × vocab`), until the next pass.
    pub fn logits(&self) -> Option<&B::Tensor> {
        self.kept.last().map(|(_, k)| &k.logits)
    }

    /// The current shape's logits tensors.
    fn current(&self) -> &KeptLogits<B::Tensor> {
        self.kept.last().expect("kept by the caller").1
    }

    /// The kept logits, narrowed or whole, on the host.
    fn download(&self, backend: &B, layers: &ModelLayers<B>) -> Result<StepLogits> {
        let kept = self.current();
        Ok(match &kept.top {
            Some(top) => StepLogits::top(backend.dims(top).1 / 2, backend.download_tensor(top)?),
            None => StepLogits::Whole {
                vocab: layers.config.vocab_size,
                logits: backend.download_tensor(&kept.logits)?,
            },
        })
    }

    /// The step's logits left in the kept tensors of `shape`: replayed, recorded, or run op by
    /// op. Ranks that record their steps (several ranks of a recordable step) do what the most
    /// cautious of them votes, and keep a recording only where every rank made one: a
    /// collective in a graph must be captured, and replayed, on every rank or on none.
    fn step<C: Transport<B>>(
        &mut self,
        backend: &B,
        layers: &ModelLayers<B>,
        caches: &mut [B::Kv],
        attention: &mut RankAttention<B, C>,
        rows: StepRows,
        shape: PassShape,
    ) -> Result<()> {
        let recordable = self.graphs && attention.recordable();
        // `graphs` is the same on every rank: set alike, and cleared only by an agreed failure.
        let together = recordable && attention.ranks() > 1;
        let key = if recordable {
            stage(backend, rows, shape, attention.generation())?
        } else {
            None
        };
        let recorder = &mut self.recorder;
        let mine = key.map_or(Vote::Eager, |k| recorder.vote(k));
        let vote = agree(attention, together, mine)?;
        let (_, kept) = self.kept.last_mut().expect("kept by the caller");
        let mut run = |attention: &mut RankAttention<B, C>| {
            let out = (&mut kept.logits, kept.top.as_mut());
            pass(backend, layers, caches, attention, rows, None, out).map(drop)
        };
        let key = match (recorder.follow(key, mine, vote), key) {
            (Vote::Replay, Some(key)) => {
                let graph = recorder.graph(key).expect("every rank voted to replay");
                return Ok(backend.replay(graph)?);
            }
            (Vote::Record, Some(key)) => key,
            _ => return run(attention),
        };
        backend.begin_capture()?;
        let ran = run(attention);
        let ended = backend.end_capture();
        let failed = match (&ran, &ended) {
            (Err(e), _) => Some(e.to_string()),
            (Ok(_), Err(e)) => Some(e.to_string()),
            (Ok(_), Ok(_)) => None,
        };
        let mine = if failed.is_some() {
            Vote::Eager
        } else {
            Vote::Record
        };
        let everywhere = agree(attention, together, mine)?;
        match (ended, everywhere) {
            (Ok(graph), Vote::Record) => {
                backend.replay(&graph)?;
                recorder.keep(key, graph);
                Ok(())
            }
            _ => {
                let why = failed.unwrap_or_else(|| "another rank's recording failed".into());
                tracing::warn!("decode steps run op by op: recording one failed: {why}");
                self.graphs = false;
                run(attention)
            }
        }
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
    ) -> Result<(StepLogits, Option<f64>)> {
        self.keep_logits(backend, layers, rows.ids.len(), rows.reach)?;
        let (_, kept) = self.kept.last_mut().expect("kept above");
        let out = (&mut kept.logits, kept.top.as_mut());
        let merge_s = pass(backend, layers, caches, attention, rows, Some(settle), out)?;
        Ok((self.download(backend, layers)?, merge_s))
    }

    /// Makes the logits tensors of `rows` rows, each narrowed to `reach` tokens, the current
    /// ones: those kept for that shape, else new ones, which push out the least recently used
    /// shape's (and its recording) past [`KEPT_PASSES`].
    fn keep_logits(
        &mut self,
        backend: &B,
        layers: &ModelLayers<B>,
        rows: usize,
        reach: Option<usize>,
    ) -> Result<PassShape> {
        let vocab = layers.config.vocab_size;
        // A vocabulary smaller than the reach is narrowed to all of it, in order.
        let narrowed = reach.map_or(0, |k| 2 * k.min(vocab));
        let shape = PassShape { rows, narrowed };
        let kept = match self.kept.take(&shape) {
            Some(kept) => kept,
            None => {
                if let Some((gone, _)) = self.kept.make_room() {
                    self.recorder.forget(gone);
                }
                KeptLogits {
                    logits: backend.tensor(rows, vocab)?,
                    top: reach.map(|_| backend.tensor(rows, narrowed)).transpose()?,
                }
            }
        };
        self.kept.push(shape, kept);
        Ok(shape)
    }
}

/// The largest vote of the ranks that record `together` (else this rank's own).
fn agree<B: LayerOps, C: Transport<B>>(
    attention: &RankAttention<B, C>,
    together: bool,
    vote: Vote,
) -> Result<Vote> {
    Ok(match together {
        true => Vote::from_u8(attention.agree_max(vote as u8)?),
        false => vote,
    })
}

/// Stages the step's inputs where a recorded pass reads them and gives the key of the step,
/// of `shape` (`None`: the backend records no graphs).
fn stage<B: LayerOps>(
    backend: &B,
    rows: StepRows,
    shape: PassShape,
    attention: u64,
) -> Result<Option<PassKey>> {
    if backend.graph_epoch().is_none() {
        return Ok(None);
    }
    backend.stage_step(rows.ids, rows.positions, rows.stores)?;
    // Staging may have made a larger input buffer: the epoch is read after it.
    Ok(backend.graph_epoch().map(|epoch| PassKey {
        shape,
        epoch,
        attention,
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
    (logits, top): (&mut B::Tensor, Option<&mut B::Tensor>),
) -> Result<Option<f64>> {
    let shape = layers.attn_shape();
    let n = rows.ids.len();
    let mut x = layers.embed(backend, rows.ids)?;
    let mut attn = layers.attention_output(backend, n)?;
    // No buffer is allocated or freed between a layer's first kernel and its last (see
    // `QkvScratch`): the activations every layer writes again are the pass's, and a layer's
    // queries, which become its attention's, are allocated before its first kernel and freed
    // after its last, between two GEMVs (which launch once the kernel before them is done).
    let (mut qkv, mut mlp) = (
        layers.qkv_scratch(backend, n)?,
        layers.mlp_scratch(backend, n)?,
    );
    let mut merge_s: Option<f64> = None;
    for (l, cache) in caches.iter_mut().enumerate() {
        let mut q = layers.query_rows(backend, n)?;
        let store = Some((&mut *cache, rows.stores));
        layers.qkv_with(backend, l, &x, rows.positions, store, &mut qkv, &mut q)?;
        let q = backend.take_queries(&shape, q)?;
        let (states, written) = match settle {
            None => attention.attend_output(cache, &q, &mut attn)?,
            Some(settle) => {
                let (states, seconds) = attention.attend_timed(cache, &q, settle)?;
                if let Some(s) = seconds {
                    *merge_s.get_or_insert(0.0) += s;
                }
                (states, false)
            }
        };
        match written {
            true => layers.finish_output(backend, l, &mut x, &attn, &mut mlp)?,
            false => layers.finish_states(backend, l, &mut x, states, &mut attn, &mut mlp)?,
        }
    }
    let rows: Vec<usize> = (0..backend.dims(logits).0).collect();
    layers.logits_into(backend, &x, &rows, logits)?;
    if let Some(top) = top {
        let k = backend.dims(top).1 / 2;
        backend.top_logits(logits, k, top)?;
    }
    Ok(merge_s)
}

/// The rows of a pass read beyond their narrowed form, by their place among its rows: whole,
/// reduced for their drawn tokens' log-probabilities, reduced to their softmax totals at
/// their temperatures (draws over the whole vocabulary), or with some tokens' logits picked
/// (draws that change them). A row's total leaves out the tokens picked from it: the draw
/// adds their changed terms itself.
#[derive(Default)]
pub(crate) struct RowReads {
    pub whole: Vec<usize>,
    pub terms: Vec<usize>,
    /// With each row's temperature.
    pub totals: Vec<(usize, f32)>,
    /// With each row's tokens.
    pub picks: Vec<(usize, Vec<u32>)>,
}

impl RowReads {
    /// The rows' softmax totals queued on the backend behind the pass that wrote `logits`,
    /// for [`RowReads::read`] (`None` where no row is drawn at a temperature): queued as the
    /// pass is launched, they run on the device right after it, not once the host has the
    /// narrowed rows.
    pub(crate) fn queue_totals<B: LayerOps>(
        &self,
        backend: &B,
        logits: &B::Tensor,
    ) -> Result<Option<B::Tensor>> {
        if self.totals.is_empty() {
            return Ok(None);
        }
        let picks = self.picks_inside(backend.dims(logits).1);
        queue_softmax_totals(backend, logits, &self.totals, &picks).map(Some)
    }

    /// The reads of `logits` (the pass's rows on the backend) into `step`; the softmax totals
    /// from `queued` ([`RowReads::queue_totals`]) where given.
    pub(crate) fn read<B: LayerOps>(
        &self,
        backend: &B,
        logits: &B::Tensor,
        step: &mut StepLogits,
        queued: Option<B::Tensor>,
    ) -> Result<()> {
        read_whole(backend, logits, &self.whole, step)?;
        read_terms(backend, logits, &self.terms, step)?;
        if let StepLogits::Top { totals, picked, .. } = step {
            let picks = self.picks_inside(backend.dims(logits).1);
            let queued = match queued {
                Some(queued) => Some(queued),
                None => self.queue_totals(backend, logits)?,
            };
            if let Some(queued) = queued {
                let read = backend.download_tensor(&queued)?;
                totals.extend(self.totals.iter().map(|&(r, _)| r).zip(read));
            }
            pick_logits(backend, logits, picks, picked)?;
        }
        Ok(())
    }

    /// The picks, less tokens past the vocabulary (which change no logit).
    fn picks_inside(&self, vocab: usize) -> Vec<(usize, Vec<u32>)> {
        (self.picks.iter())
            .map(|(r, tokens)| {
                let inside = tokens.iter().copied().filter(|&t| (t as usize) < vocab);
                (*r, inside.collect())
            })
            .collect()
    }
}

/// The logits of each `(row, tokens)` of `picks` in `logits` (a pass's, on the backend) into
/// `picked`, with their tokens, by row, in one [`LayerOps::pick_logits`].
fn pick_logits<B: LayerOps>(
    backend: &B,
    logits: &B::Tensor,
    picks: Vec<(usize, Vec<u32>)>,
    picked: &mut BTreeMap<usize, Vec<(u32, f32)>>,
) -> Result<()> {
    let flat: Vec<(u32, u32)> = (picks.iter())
        .flat_map(|(r, tokens)| tokens.iter().map(move |&t| (*r as u32, t)))
        .collect();
    if flat.is_empty() {
        return Ok(());
    }
    let mut out = backend.output_tensor(flat.len(), 1)?;
    backend.pick_logits(logits, &flat, &mut out)?;
    let mut values = backend.download_tensor(&out)?.into_iter();
    for (r, tokens) in picks {
        picked.insert(r, tokens.into_iter().zip(values.by_ref()).collect());
    }
    Ok(())
}

/// Rows `rows` of `logits` reduced into `step` for their drawn tokens' log-probabilities
/// ([`row_terms`], the [`LOGPROBS_MAX`] likeliest), beside their narrowed form (a step read
/// whole holds them already).
fn read_terms<B: LayerOps>(
    backend: &B,
    logits: &B::Tensor,
    rows: &[usize],
    step: &mut StepLogits,
) -> Result<()> {
    let StepLogits::Top { terms, .. } = step else {
        return Ok(());
    };
    if rows.is_empty() {
        return Ok(());
    }
    let mut gathered = backend.output_tensor(rows.len(), backend.dims(logits).1)?;
    backend.gather_rows(logits, rows, &mut gathered)?;
    // The drawn token's logit comes from the narrowed row; the target is a stand-in.
    let reduced = row_terms(backend, &gathered, LOGPROBS_MAX, &vec![0; rows.len()])?;
    terms.extend(
        rows.iter()
            .copied()
            .zip(reduced.into_iter().map(|(t, _)| t)),
    );
    Ok(())
}

/// Rows `rows` of `logits` read whole into `step` beside their narrowed form (a step read
/// whole holds them already).
fn read_whole<B: LayerOps>(
    backend: &B,
    logits: &B::Tensor,
    rows: &[usize],
    step: &mut StepLogits,
) -> Result<()> {
    let StepLogits::Top { whole, .. } = step else {
        return Ok(());
    };
    if rows.is_empty() {
        return Ok(());
    }
    let read = download_rows(backend, logits, rows)?;
    whole.extend((rows.iter().enumerate()).map(|(i, &r)| (r, read.row(i).to_vec())));
    Ok(())
}

/// Rows of a pass's logits on the host, whole, one after another in the order they were
/// asked for: one buffer, read in one copy, which the rows are slices of.
pub(crate) struct WholeRows {
    vocab: usize,
    data: Vec<f32>,
}

impl WholeRows {
    /// Rows of `vocab` logits each, one after another in `data`.
    pub(crate) fn new(vocab: usize, data: Vec<f32>) -> WholeRows {
        debug_assert!(vocab > 0 && data.len().is_multiple_of(vocab));
        WholeRows { vocab, data }
    }

    /// The `i`th row read.
    pub(crate) fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.vocab..(i + 1) * self.vocab]
    }

    /// The rows read, in order.
    pub(crate) fn rows(&self) -> std::slice::ChunksExact<'_, f32> {
        self.data.chunks_exact(self.vocab)
    }
}

/// Where a tail walk landed: the token and its logit (`None`: no token past the walk's head
/// has a probability above 0).
pub(crate) type Landed = Option<(u32, f32)>;

/// Where each `(row, walk)` of `walks` lands in `logits` (a pass's, on the backend)
/// ([`LayerOps::walk_tails`]).
pub(crate) fn walk_tails<B: LayerOps>(
    backend: &B,
    logits: &B::Tensor,
    walks: &[(usize, &TailWalk)],
) -> Result<Vec<Landed>> {
    if walks.is_empty() {
        return Ok(Vec::new());
    }
    let mut out = backend.output_tensor(walks.len(), 2)?;
    backend.walk_tails(logits, walks, &mut out)?;
    let landed = backend.download_tensor(&out)?;
    Ok((landed.chunks_exact(2))
        .map(|w| Some((w[0].to_bits(), w[1])).filter(|&(t, _)| t != u32::MAX))
        .collect())
}

/// Rows `rows` of `logits` (a pass's, on the backend) whole on the host.
pub(crate) fn download_rows<B: LayerOps>(
    backend: &B,
    logits: &B::Tensor,
    rows: &[usize],
) -> Result<WholeRows> {
    let vocab = backend.dims(logits).1;
    if rows.is_empty() {
        return Ok(WholeRows::new(vocab, Vec::new()));
    }
    let mut gathered = backend.output_tensor(rows.len(), vocab)?;
    backend.gather_rows(logits, rows, &mut gathered)?;
    Ok(WholeRows::new(vocab, backend.download_tensor(&gathered)?))
}

/// The softmax totals of rows of `logits` (a pass's, on the backend), each `(row,
/// temperature)` of `rows` ([`LayerOps::softmax_totals`]), without the tokens `picks` names
/// for them: those are set to `-∞` in the rows' copy ([`LayerOps::set_logits`]). Returns the
/// tensor they are queued into (`rows × 1`).
fn queue_softmax_totals<B: LayerOps>(
    backend: &B,
    logits: &B::Tensor,
    rows: &[(usize, f32)],
    picks: &[(usize, Vec<u32>)],
) -> Result<B::Tensor> {
    let (places, temperatures): (Vec<usize>, Vec<f32>) = rows.iter().copied().unzip();
    let (all_rows, vocab) = backend.dims(logits);
    let left_out: Vec<(u32, u32)> = (places.iter().enumerate())
        .filter_map(|(i, r)| picks.iter().find(|(p, _)| p == r).map(|(_, t)| (i, t)))
        .flat_map(|(i, tokens)| tokens.iter().map(move |&t| (i as u32, t)))
        .collect();
    let mut totals = backend.output_tensor(rows.len(), 1)?;
    // Every row in order with nothing left out (a step drawing all its rows at a temperature)
    // is read where it lies; otherwise the rows are gathered and their picks masked.
    if left_out.is_empty() && places.iter().copied().eq(0..all_rows) {
        backend.softmax_totals(logits, &temperatures, &mut totals)?;
    } else {
        let mut gathered = backend.output_tensor(rows.len(), vocab)?;
        backend.gather_rows(logits, &places, &mut gathered)?;
        backend.set_logits(&mut gathered, &left_out, f32::NEG_INFINITY)?;
        backend.softmax_totals(&gathered, &temperatures, &mut totals)?;
    }
    Ok(totals)
}

/// Each row of `logits` reduced on the backend to its log-normaliser and `n` likeliest tokens
/// ([`RowTerms`]), with the logit of its token of `targets`.
pub(crate) fn row_terms<B: LayerOps>(
    backend: &B,
    logits: &B::Tensor,
    n: usize,
    targets: &[u32],
) -> Result<Vec<(RowTerms, f32)>> {
    let (rows, vocab) = backend.dims(logits);
    // `top_logits` narrows to one token at least.
    let k = n.clamp(1, vocab);
    let mut likeliest = backend.output_tensor(rows, 2 * k)?;
    backend.top_logits(logits, k, &mut likeliest)?;
    let mut terms = backend.output_tensor(rows, 2)?;
    backend.logprob_terms(logits, targets, &mut terms)?;
    let likeliest = backend.download_tensor(&likeliest)?;
    let terms = backend.download_tensor(&terms)?;
    Ok((likeliest.chunks_exact(2 * k).zip(terms.chunks_exact(2)))
        .map(|(row, terms)| {
            let (logits, tokens) = row.split_at(k);
            let top = (tokens.iter().zip(logits).take(n))
                .map(|(t, &x)| (t.to_bits(), x))
                .collect();
            (RowTerms { lse: terms[0], top }, terms[1])
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use canopy_core::logits::softmax_total;
    use canopy_engine::CpuBackend;

    /// A row's total leaves out the tokens picked from it, and their logits come back beside
    /// it; a row without picks is summed whole.
    #[test]
    fn a_rows_total_leaves_out_the_tokens_picked_from_it() {
        let b = CpuBackend;
        let data: Vec<f32> = (0..24).map(|i| ((i * 7) % 11) as f32 * 0.4).collect();
        let logits = b.upload_tensor(&data, 3, 8).unwrap();
        let reads = RowReads {
            totals: vec![(0, 0.7), (2, 1.3)],
            picks: vec![(2, vec![3, 5, 99]), (1, vec![0])],
            ..RowReads::default()
        };
        let mut step = StepLogits::top(1, vec![0.0; 6]);
        reads.read(&b, &logits, &mut step, None).unwrap();
        let StepLogits::Top { totals, picked, .. } = &step else {
            unreachable!()
        };
        let mut left = data[16..24].to_vec();
        (left[3], left[5]) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
        assert_eq!(totals[&0], softmax_total(&data[..8], 0.7));
        assert_eq!(totals[&2], softmax_total(&left, 1.3));
        assert_ne!(totals[&2], softmax_total(&data[16..24], 1.3));
        assert_eq!(
            picked[&2],
            [(3, data[19]), (5, data[21])],
            "99 is past the row"
        );
        assert_eq!(picked[&1], [(0, data[8])]);
    }
}
