//! One rank of a generation: every rank holds the whole model and runs every layer; the KV
//! cache is sharded along the sequence, and attention is where the ranks meet.
//!
//! **Prefill, sequence-parallel.** The prompt runs in pieces, each cut into one chunk a rank
//! (an early block of the piece and its mirror, [`KvLayout`]); rank `r` runs the layers on
//! its chunk and keeps that chunk's keys and values. At each layer the ranks exchange the
//! piece's keys and values (the first piece) or its queries and partial states (a later one,
//! whose queries also see the keys each rank holds), then attend and, in a later piece, merge.
//! The last piece's last row gives the first token's logits, which reach every rank by an
//! all-reduce.
//!
//! **Decode.** Every rank computes every live sample's new token through all layers (the
//! weights are replicated), and each new key and value is stored on one rank, the one with
//! the fewest tokens ([`KvLayout`]). At each layer the query attends to the rank's shard with
//! the engine's [`RankAttention`] — plans built from the rank's view of the KV tree, shared
//! prompt pages read once for every sample — and the states are merged across ranks by the
//! tree collectives or gathered by the ring. Every rank ends each step with the same logits,
//! and so draws the same tokens.

use crate::forward::{download_rows, walk_tails, Forward, RowReads, StepRows, WholeRows};
use crate::kv::{KvLayout, RankChange, RankView, SEQUENCE_GROWTH_ROOM};
use crate::layers::{model_needs, ModelLayers};
use crate::prefill::{fill_random, prefill};
use crate::sampling::{
    step_reach, token_logprobs, RowLogits, Sampler, SamplingParams, StepLogits, TokenLogprobs,
    TopTwo,
};
use crate::{Result, RuntimeError};
use canopy_comm::Collective;
use canopy_core::logits::TailWalk;
use canopy_core::{plan, AttnShape, DType, Method, Plan, PlannerConfig, Shard, Tail, TreeView};
use canopy_engine::{
    LayerOps, MergeCollective, ModelNeeds, NodeLayout, RankAttention, RingShard, Transport,
};
use std::time::Instant;

/// How decode attention combines the ranks' shards: the engine's strategies (the tree's
/// partial attention on each rank merged by a collective, `auto` chosen by the cost model
/// calibrated on this world; or the ring baseline, every shard's KV passing every rank).
pub use canopy_engine::Strategy as DecodeStrategy;

/// What to generate.
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    /// Parallel samples of the same prompt, decoded as one tree.
    pub samples: usize,
    pub sampling: SamplingParams,
    pub seed: u64,
    /// Tokens that end a sample (the model's end-of-sequence ids).
    pub stop_tokens: Vec<u32>,
    pub strategy: DecodeStrategy,
    /// How each rank plans its shard.
    pub method: Method,
    /// KV page size (tokens).
    pub page_size: u32,
    /// The KV caches' dtype.
    pub kv_dtype: DType,
    /// How the prompt's keys and values reach the cache.
    pub context_fill: ContextFill,
    /// Prompt tokens each rank prefills in one pass (rounded up to whole pages): the prompt
    /// runs in pieces of `ranks ·` this many, which bounds a prefill's activations.
    pub prefill_chunk: usize,
    /// Whether decode steps may replay a recorded pass where the backend records graphs
    /// (CUDA, one rank); `false` runs every step op by op.
    pub graphs: bool,
    /// Report each drawn token's log-probability with this many of its row's likeliest
    /// tokens (`None`: none); every step then reads its rows whole.
    pub logprobs: Option<usize>,
}

/// [`GenerateRequest::prefill_chunk`] unless set: large enough that the GEMMs run at their
/// rate, small enough that activations stay a small part of a GPU's memory.
pub const DEFAULT_PREFILL_CHUNK: usize = 8192;

/// How the prompt's keys and values reach the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ContextFill {
    /// The prompt runs through the model (the sequence-parallel prefill).
    #[default]
    Prefill,
    /// Random keys and values stand in for the prompt's, drawn from `seed` by position, so
    /// that decode can be timed at contexts whose prefill would not fit a run. The first
    /// token is drawn from flat logits and the text means nothing.
    Random { seed: u64 },
}

impl GenerateRequest {
    /// What this request asks of a backend running `ranks_here` of the world's `ranks` ranks
    /// with `config`'s model in `weight_dtype`: checked by [`LayerOps::check_model`] before the
    /// weights are uploaded.
    pub fn needs(
        &self,
        config: &canopy_model::LlamaConfig,
        weight_dtype: DType,
        ranks: usize,
        ranks_here: usize,
    ) -> Result<ModelNeeds> {
        let prompt = self.prompt.len();
        self.check_capacity(config.max_position_embeddings)?;
        self.needs_at(prompt, config, weight_dtype, ranks, ranks_here)
    }

    /// Refuses a request whose prompt and new tokens pass the model's `capacity` positions:
    /// before its pricing, whose refusal would name memory rather than the positions.
    fn check_capacity(&self, capacity: usize) -> Result<()> {
        if self.prompt.len().saturating_add(self.max_tokens) > capacity {
            return Err(RuntimeError::TooLong {
                prompt: self.prompt.len(),
                max_tokens: self.max_tokens,
                capacity,
            });
        }
        Ok(())
    }

    /// [`GenerateRequest::needs`] of this request with a prompt of `prompt` tokens instead of
    /// its own: prices other context lengths without building their prompts.
    pub fn needs_at(
        &self,
        prompt: usize,
        config: &canopy_model::LlamaConfig,
        weight_dtype: DType,
        ranks: usize,
        ranks_here: usize,
    ) -> Result<ModelNeeds> {
        let layout = self.layout(prompt, ranks)?;
        // A prefill pass carries a chunk of rows (padded to the piece's widest) and attends
        // every rank's, gathered, to at most the rank's share of the prompt.
        let chunk = layout.widest_chunk();
        let (max_rows, attention_rows, attention_keys) = match self.context_fill {
            ContextFill::Prefill => (
                chunk.max(self.samples),
                chunk * ranks,
                (0..ranks)
                    .map(|r| layout.prompt_runs(r).map(|run| run.len()).sum::<usize>())
                    .max()
                    .unwrap_or(0),
            ),
            ContextFill::Random { .. } => (self.samples, 0, 0),
        };
        let mut needs = model_needs(
            config,
            weight_dtype,
            self.kv_dtype,
            layout.pool_tokens() * ranks_here,
            max_rows,
            // The logits of each shape a decode pass keeps, as samples end.
            crate::forward::KEPT_PASSES * self.samples,
        );
        needs.attention_rows = attention_rows;
        needs.attention_keys = attention_keys;
        Ok(needs)
    }

    /// Where this request's KV goes with a prompt of `prompt` tokens over `ranks` ranks. An
    /// empty prompt is refused here, where pricing and generating both pass.
    fn layout(&self, prompt: usize, ranks: usize) -> Result<KvLayout> {
        if prompt == 0 {
            return Err(RuntimeError::EmptyPrompt);
        }
        let layout = KvLayout::new(
            ranks,
            self.page_size,
            prompt,
            self.samples,
            self.max_tokens,
            self.prefill_chunk,
        )?;
        // The ring keeps no growth room: it sends every logical address of a shard, room
        // included. Its plans still carry over the steps whose tokens land in pages the shards
        // already had.
        Ok(match self.strategy {
            DecodeStrategy::Tree(_) => layout.with_growth_room(SEQUENCE_GROWTH_ROOM),
            DecodeStrategy::Ring => layout,
        })
    }
}

/// What a caller sees of a generation as it runs on one rank. Each rank is given its own;
/// all must answer alike ([`Watch::token`], [`Watch::time_merges`]), since the ranks step
/// together. A closure `FnMut(sample, token) -> bool` is a watch of the tokens alone.
pub trait Watch {
    /// Sample `sample` drew `token` (in order); `false` ends that sample (a stop string in its
    /// text).
    fn token(&mut self, sample: usize, token: u32) -> bool;
    /// `done` of `passes` passes have filled this rank's part of the context: a long
    /// context's progress. A prefill's pass is one layer of one piece of the prompt; a random
    /// fill's, one layer.
    fn context_progress(&mut self, done: usize, passes: usize) {
        let _ = (done, passes);
    }
    /// Whether decode steps time the tree's cross-rank merges: with more than one rank, every
    /// second step (the second, the fourth, ...) waits for the device around each layer's
    /// merge ([`RankAttention::attend_timed`]) and reports the merges' time in
    /// [`Generated::merge_s`]; the other steps run undisturbed. Provided: no.
    fn time_merges(&self) -> bool {
        false
    }
}

impl<F: FnMut(usize, u32) -> bool> Watch for F {
    fn token(&mut self, sample: usize, token: u32) -> bool {
        self(sample, token)
    }
}

/// One rank's outcome: the samples' tokens (every rank has them all) and its timings.
#[derive(Debug, Clone)]
pub struct Generated {
    pub samples: Vec<Vec<u32>>,
    /// Whether each sample ended on a stop token or by the watch (else on the token limit).
    pub stopped: Vec<bool>,
    /// Seconds to fill the context: the prefill, or the random fill.
    pub prefill_s: f64,
    /// Seconds from the call to the first token drawn (the KV caches' allocation, the fill,
    /// the merge's choice and the draw): the time to first token. `None` if none was drawn.
    pub first_token_s: Option<f64>,
    /// Seconds of each decode step after the first token.
    pub step_s: Vec<f64>,
    /// For each decode step, the seconds its layers spent in the cross-rank merge where the
    /// step timed them ([`Watch::time_merges`]); such a step's `step_s` includes the waits.
    pub merge_s: Vec<Option<f64>>,
    /// The first token's logits (every rank has the same), for checks against a reference.
    pub first_logits: Vec<f32>,
    /// The two most likely tokens of each step of sample 0, for checks of greedy agreement
    /// against a reference: where its top two are close, another backend's rounding may
    /// rightly pick the other.
    pub top_two: Vec<TopTwo>,
    /// Decode steps replayed from a recorded pass ([`GenerateRequest::graphs`]).
    pub replayed_steps: usize,
    /// Each sample's tokens' log-probabilities, where [`GenerateRequest::logprobs`] asks.
    pub logprobs: Vec<Vec<TokenLogprobs>>,
}

/// Runs `req` on this rank of `comm`. Every rank of the world calls it with the same request;
/// `watch` sees each new token as it is drawn and may end its sample, and follows the
/// context's fill (see [`Watch`]). Every rank must answer alike: the ranks hold the same
/// tokens, so a decision made from them is.
pub fn generate<B: LayerOps, C: Collective + Transport<B>>(
    backend: &B,
    layers: &ModelLayers<B>,
    req: &GenerateRequest,
    comm: &C,
    watch: &mut dyn Watch,
) -> Result<Generated> {
    let called = Instant::now();
    let (rank, ranks) = (comm.rank(), comm.size());
    req.check_capacity(layers.config.max_position_embeddings)?;
    let shape = layers.attn_shape();
    let mut kv = req.layout(req.prompt.len(), ranks)?;
    // The pools were priced by `LayerOps::check_model` before the weights were uploaded.
    let mut caches: Vec<B::Kv> = (0..layers.num_layers())
        .map(|_| backend.alloc_kv(&shape, req.kv_dtype, kv.pool_tokens()))
        .collect::<canopy_engine::Result<_>>()?;

    let t0 = Instant::now();
    let vocab = layers.config.vocab_size;
    let num_layers = layers.num_layers();
    let logits = match req.context_fill {
        ContextFill::Prefill => {
            let on_pass = &mut |done, passes| watch.context_progress(done, passes);
            prefill(backend, layers, req, comm, &kv, &mut caches, on_pass)?
        }
        ContextFill::Random { seed } => {
            let on_layer = &mut |done| watch.context_progress(done, num_layers);
            fill_random(backend, layers, &kv, rank, seed, &mut caches, on_layer)?;
            // A GPU's fill is asynchronous: waited for here, its time is the fill's and not
            // the first step's.
            backend.synchronize()?;
            vec![0.0; vocab]
        }
    };
    let prefill_s = t0.elapsed().as_secs_f64();
    let first_logits = logits;

    let mut samplers: Vec<Sampler> = (0..req.samples)
        .map(|i| Sampler::new(req.sampling, req.seed.wrapping_add(i as u64), &req.prompt))
        .collect();
    let mut out: Vec<Vec<u32>> = vec![Vec::new(); req.samples];
    let mut stopped = vec![false; req.samples];
    // Each sample's last logits: the first token's whole row, then its row of each step.
    let first = StepLogits::Whole {
        vocab,
        logits: first_logits.clone(),
    };
    let mut step_logits: Vec<StepLogits> = vec![first; req.samples];
    // Each sample's row in the last pass, where a draw that lands past its narrowed row reads
    // it whole.
    let mut pass_rows = vec![0; req.samples];
    let mut logprobs = vec![Vec::new(); req.samples];
    let mut step_s = Vec::new();
    let mut merge_s = Vec::new();
    let mut first_token_s = None;
    let mut top_two = Vec::new();
    let merge = resolve_merge(
        req.strategy,
        comm,
        req.samples * shape.q_heads,
        shape.head_dim,
    )?;
    let mut attention: Option<RankAttention<B, C>> = None;
    let mut forward = Forward::new().with_graphs(req.graphs);
    loop {
        // Draw each live sample's token from its logits; draws that land past their narrowed
        // rows go on together over the rest of the rows on the backend, or over a row read.
        let drawing: Vec<usize> = (0..req.samples)
            .filter(|&s| !stopped[s] && out[s].len() < req.max_tokens)
            .collect();
        if drawing.first() == Some(&0) {
            top_two.push(TopTwo::of(step_logits[0].row(0)));
        }
        let mut drawn: Vec<Option<(u32, Option<Past>)>> = (drawing.iter())
            .map(|&s| {
                let row = step_logits[s].row(0);
                samplers[s]
                    .sample(row, step_logits[s].total(0))
                    .map(|t| (t, None))
            })
            .collect();
        if drawn.iter().any(Option::is_none) {
            let kept = forward.logits().ok_or_else(|| {
                RuntimeError::Protocol("a narrowed row without its pass's logits".into())
            })?;
            let rows: Vec<(usize, Option<f32>)> = (drawing.iter())
                .map(|&s| (pass_rows[s], step_logits[s].total(0)))
                .collect();
            finish_past(backend, kept, &rows, &drawing, &mut samplers, &mut drawn)?;
        }
        let mut live = Vec::new();
        for (&s, drawn) in drawing.iter().zip(drawn) {
            let (token, past) = drawn.expect("every draw finished");
            if let Some(n) = req.logprobs {
                let terms = step_logits[s].terms(0);
                logprobs[s].extend(match &past {
                    Some(Past::Whole(row)) => {
                        token_logprobs(RowLogits::Whole(row.row(0)), terms, token, n)
                    }
                    Some(Past::Tail(Some(x))) => terms.map(|t| t.logprobs(*x, n)),
                    _ => token_logprobs(step_logits[s].row(0), terms, token, n),
                });
            }
            first_token_s.get_or_insert_with(|| called.elapsed().as_secs_f64());
            out[s].push(token);
            let go_on = watch.token(s, token);
            if !go_on || req.stop_tokens.contains(&token) {
                stopped[s] = true;
            } else if out[s].len() < req.max_tokens {
                live.push(s);
            }
        }
        if live.is_empty() {
            break;
        }
        // One decode step for the live samples: their last tokens through every layer.
        let t = Instant::now();
        let ids: Vec<u32> = live
            .iter()
            .map(|&s| *out[s].last().expect("drawn"))
            .collect();
        let positions: Vec<u32> = live
            .iter()
            .map(|&s| (req.prompt.len() + out[s].len() - 1) as u32)
            .collect();
        let books = Instant::now();
        let placed = kv.append(&live)?;
        let mine: Vec<(u32, u32)> = placed
            .iter()
            .enumerate()
            .filter(|(_, (r, _))| *r == rank)
            .map(|(row, (_, slot))| (row as u32, *slot))
            .collect();
        // The tree plans its own rank only; the ring plans every rank's shard, since each
        // passes every rank. Both follow growth in place, the ring only where every rank's KV
        // grew in place. A layout planned afresh brings this rank's page table; growth in place
        // keeps it, or brings it again with pages in reserved room. The tree's new plan is
        // written over the old where it lays out alike, so a recorded pass still replays.
        let mut changes = kv.update()?;
        let layout = Instant::now();
        let table = match (&merge, attention.as_mut()) {
            (Some((how, nodes)), grown) => match (changes.swap_remove(rank), grown) {
                (RankChange::Grown { tails, table }, Some(a)) => {
                    a.extend(std::slice::from_ref(&tails))?;
                    table
                }
                (RankChange::Grown { .. }, None) => {
                    return Err(RuntimeError::Protocol(
                        "a rank's KV grew before its first plan".into(),
                    ))
                }
                (RankChange::Fresh(view), planned) => {
                    let p = plan_view(&view, req, &shape)?;
                    match planned {
                        Some(a) => a.replan(&p)?,
                        None => {
                            attention = Some(RankAttention::tree(
                                backend,
                                comm,
                                shape,
                                &p,
                                *how,
                                nodes.clone(),
                            )?)
                        }
                    }
                    Some(view.table)
                }
            },
            (None, grown) => match (grown_everywhere(changes, rank), grown) {
                (Some(grown), Some(a)) => {
                    a.extend(&grown.tails)?;
                    grown.table
                }
                _ => {
                    let mut views = kv.views();
                    attention = Some(ring_attention(backend, comm, req, &shape, &views)?);
                    Some(views.swap_remove(rank).table)
                }
            },
        };
        if let Some(table) = table {
            backend.set_page_tables(&mut caches, req.page_size, &table)?;
        }
        let attention = attention.as_mut().expect("planned above");
        let passed = Instant::now();
        let replayed = forward.replayed();
        // Sample 0's top two are reported, so every step keeps at least two tokens a row. A
        // penalised sample's reach grows as it draws.
        let reach = step_reach(live.iter().map(|&s| samplers[s].reach()), 2);
        let rows = StepRows {
            ids: &ids,
            positions: &positions,
            stores: &mine,
            reach,
        };
        // Draws over the whole vocabulary read their rows' softmax totals, draws that change
        // logits those tokens' logits, and reported log-probabilities the rows reduced on the
        // backend (a step read whole has its rows).
        let reads = RowReads {
            whole: Vec::new(),
            terms: match req.logprobs {
                Some(_) => (0..live.len()).collect(),
                None => Vec::new(),
            },
            totals: (live.iter().enumerate())
                .filter_map(|(row, &s)| samplers[s].total_temperature().map(|t| (row, t)))
                .collect(),
            picks: (live.iter().enumerate())
                .map(|(row, &s)| (row, samplers[s].picks()))
                .filter(|(_, picks)| !picks.is_empty())
                .collect(),
        };
        let probe = watch.time_merges() && ranks > 1 && step_s.len() % 2 == 1;
        let mut totals = None;
        let (mut logits, merged) = if probe {
            let settle = || Ok(comm.barrier()?);
            forward.decode_timed(backend, layers, &mut caches, attention, rows, &settle)?
        } else {
            // The totals are queued behind the pass as it is launched.
            let mut queue = |kept: &B::Tensor| -> Result<()> {
                totals = reads.queue_totals(backend, kept)?;
                Ok(())
            };
            let logits =
                forward.decode(backend, layers, &mut caches, attention, rows, &mut queue)?;
            (logits, None)
        };
        if let Some(kept) = forward.logits() {
            reads.read(backend, kept, &mut logits, totals)?;
        }
        for (row, &s) in live.iter().enumerate() {
            step_logits[s] = logits.row_owned(row);
            pass_rows[s] = row;
        }
        tracing::debug!(
            rows = live.len(),
            books_ms = ms(layout - books),
            layout_ms = ms(passed - layout),
            pass_ms = ms(passed.elapsed()),
            replayed = forward.replayed() > replayed,
            "decode step"
        );
        step_s.push(t.elapsed().as_secs_f64());
        merge_s.push(merged);
    }
    Ok(Generated {
        samples: out,
        stopped,
        prefill_s,
        first_token_s,
        step_s,
        merge_s,
        first_logits,
        top_two,
        logprobs,
        replayed_steps: forward.replayed(),
    })
}

/// How a draw that landed past its narrowed row went on.
enum Past {
    /// Over the rest of the row on the backend, landing on a token of this logit (`None`: on
    /// the head's last token).
    Tail(Option<f32>),
    /// Over the whole row, read.
    Whole(WholeRows),
}

/// Finishes the draws of `drawn` (of samples `drawing`, each with its row of `logits`, the
/// pass's on the backend, and its total, in `rows`) that landed past their narrowed rows: over
/// the rest of their rows on the backend in one walk where their samplers can
/// ([`Sampler::tail_walk`]), else each over its whole row read.
fn finish_past<B: LayerOps>(
    backend: &B,
    logits: &B::Tensor,
    rows: &[(usize, Option<f32>)],
    drawing: &[usize],
    samplers: &mut [Sampler],
    drawn: &mut [Option<(u32, Option<Past>)>],
) -> Result<()> {
    let past: Vec<usize> = (0..drawn.len()).filter(|&i| drawn[i].is_none()).collect();
    let walks: Vec<(usize, TailWalk)> = (past.iter())
        .filter_map(|&i| Some((i, samplers[drawing[i]].tail_walk()?.clone())))
        .collect();
    let at: Vec<(usize, &TailWalk)> = walks.iter().map(|(i, w)| (rows[*i].0, w)).collect();
    for (&(i, _), landed) in walks.iter().zip(walk_tails(backend, logits, &at)?) {
        let token = samplers[drawing[i]].land_tail(landed.map(|(t, _)| t));
        drawn[i] = token.map(|t| (t, Some(Past::Tail(landed.map(|(_, x)| x)))));
    }
    for i in past {
        if drawn[i].is_some() {
            continue;
        }
        let (row, total) = rows[i];
        let whole = download_rows(backend, logits, &[row])?;
        let token = samplers[drawing[i]].sample(RowLogits::Whole(whole.row(0)), total);
        let token = token.ok_or_else(|| {
            RuntimeError::Protocol("a draw past its narrowed row did not end".into())
        })?;
        drawn[i] = Some((token, Some(Past::Whole(whole))));
    }
    Ok(())
}

/// Milliseconds, for traces.
pub(crate) fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The tree's concrete merge, resolved once for a run (a generation, or a server's life):
/// `auto` times this world's collectives at the decode step's sizes and every rank takes the
/// same choice.
pub(crate) fn resolve_merge<C: Collective>(
    strategy: DecodeStrategy,
    comm: &C,
    cells: usize,
    head_dim: usize,
) -> Result<Option<(MergeCollective, NodeLayout)>> {
    let DecodeStrategy::Tree(how) = strategy else {
        return Ok(None);
    };
    let layout = canopy_engine::strategy::node_layout(comm, None)?;
    let how = match how {
        MergeCollective::Auto => {
            let (cells, d) = (cells as u64, head_dim as u64);
            canopy_engine::strategy::calibrate(comm, cells, d)?.choose(&layout, cells, d)
        }
        how => how,
    };
    Ok(Some((how, layout)))
}

/// A rank's view planned by `req.method`.
fn plan_view(view: &RankView, req: &GenerateRequest, shape: &AttnShape) -> Result<Plan> {
    let shard = Shard::whole(&view.tree);
    let cfg = PlannerConfig::default();
    Ok(plan(
        &TreeView::new(&view.tree, &shard),
        req.method,
        shape,
        &cfg,
    )?)
}

/// A step in which every rank's KV only grew in place: the ring's plans of every shard carry
/// over.
struct GrownEverywhere {
    /// Every rank's tails, in rank order.
    tails: Vec<Vec<Tail>>,
    /// The page table this rank installs, where its pages moved into reserved room.
    table: Option<Vec<u32>>,
}

/// The step's changes as [`GrownEverywhere`]; `None` where any rank's layout moved.
fn grown_everywhere(changes: Vec<RankChange>, rank: usize) -> Option<GrownEverywhere> {
    let mut grown = GrownEverywhere {
        tails: Vec::with_capacity(changes.len()),
        table: None,
    };
    for (r, change) in changes.into_iter().enumerate() {
        let RankChange::Grown { tails, table } = change else {
            return None;
        };
        if r == rank {
            grown.table = table;
        }
        grown.tails.push(tails);
    }
    Some(grown)
}

/// The ring's step: every rank's view planned, since every shard passes every rank.
fn ring_attention<'a, B: LayerOps, C: Collective + Transport<B>>(
    backend: &'a B,
    comm: &'a C,
    req: &GenerateRequest,
    shape: &AttnShape,
    views: &[RankView],
) -> Result<RankAttention<'a, B, C>> {
    let shards = views
        .iter()
        .map(|v| {
            Ok(RingShard {
                plan: plan_view(v, req, shape)?,
                tokens: v.tokens,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(RankAttention::ring(
        backend,
        comm,
        *shape,
        req.kv_dtype,
        shards,
    )?)
}
