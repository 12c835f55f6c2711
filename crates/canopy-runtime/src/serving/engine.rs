//! The step loop every rank runs. Rank 0's scheduler describes each step and sends it to the
//! other ranks; every rank applies it to its books and runs the same passes:
//!
//! 1. **Decode.** The rows' tokens through every layer ([`Forward::decode`]), attention planned
//!    over the whole live KV tree: each rank plans its part of the tree (`Method::Auto` by
//!    default), so the pages of a prefix shared by many requests are read once per step, and
//!    the ranks' states merge by the tree collectives (or pass around the ring). A step that
//!    only grew branches inside their pages extends the plan in place.
//! 2. **Prefill.** The step's prompt chunks through every layer together ([`prefill_chunks`]),
//!    so that one pass over the weights serves them all, each rank running the rows whose KV
//!    it stores: causal attention within each chunk, and one plan of every chunk's rows over
//!    their cached contexts (the shared prefixes found in the cache, earlier chunks) on every
//!    rank, whose states merge as the tree's decode merges them (a ring server's too). Chunks
//!    without a cached context make a second pass. When chunks have a cached context, the
//!    step's decode rows lead their pass instead of running step 1: one pass over the
//!    weights, one plan for both.
//!
//! Rank 0 then draws the tokens. Every rank ends a step with the same logits, so every rank's
//! books stay the same without more messages.

use super::books::{Books, Layout, PrefillPass};
use super::handle::EngineInbox;
use super::scheduler::{ChunkDone, Decoded, PastReads, Scheduler, StepClock};
use super::step::{Chunk, Row, Step};
use super::{held_batch, ServeConfig};
use crate::forward::{download_rows, row_terms, walk_tails, Forward, Kept, RowReads, StepRows};
use crate::kv::GROWTH_ROOM;
use crate::layers::ModelLayers;
use crate::prefill::{prefill_chunks, ChunkPass, PrefillRows};
use crate::rank::{ms, resolve_merge};
use crate::sampling::{StepLogits, TokenLogprobs};
use crate::{Result, RuntimeError};
use canopy_comm::Collective;
use canopy_core::{plan, AttnShape, PlannerConfig, Shard, TreeView};
use canopy_engine::{LayerOps, MergeCollective, NodeLayout, RankAttention, RingShard, Transport};
use canopy_kv::RankSnapshot;
use canopy_model::Tokenizer;
use std::borrow::Cow;
use std::ops::Range;
use std::time::Instant;

/// Prompt rows whose logits are computed at once for their log-probabilities: 128 MB of fp32
/// logits on the backend at a vocabulary of 128K.
const PROMPT_LOGITS_ROWS: usize = 256;

/// Rank 0's front: the handles' commands, and what turns tokens into text and ends samples.
pub struct Front<'t> {
    pub inbox: EngineInbox,
    pub tokenizer: &'t Tokenizer,
    /// Tokens that end a sample (the model's end-of-sequence ids).
    pub stop_tokens: Vec<u32>,
}

/// Serves on this rank of `comm` until the front drains (rank 0 gives `front`; the other
/// ranks follow its steps). An error stops every rank: rank 0's requests end with it.
pub fn serve<B: LayerOps, C: Collective + Transport<B>>(
    backend: &B,
    layers: &ModelLayers<B>,
    comm: &C,
    config: &ServeConfig,
    front: Option<Front<'_>>,
) -> Result<()> {
    let rank = comm.rank();
    let mut scheduler = match (front, rank) {
        (Some(f), 0) => Some(Scheduler::new(
            f.inbox,
            f.tokenizer,
            f.stop_tokens,
            config.limits(comm.size()),
            config.prefill_chunk,
        )),
        (None, 0) => {
            return Err(RuntimeError::Protocol(
                "rank 0 of a server needs the requests' inbox".into(),
            ))
        }
        _ => None,
    };
    let mut ranks = Ranks::new(backend, layers, comm, config)?;
    let result = ranks.run(&mut scheduler);
    if let Some(s) = scheduler.as_mut() {
        match &result {
            Ok(()) => s.close(&ranks.books),
            Err(e) => s.fail_all(e),
        }
    }
    result
}

/// One rank's state between steps.
struct Ranks<'a, B: LayerOps, C: Collective + Transport<B>> {
    backend: &'a B,
    layers: &'a ModelLayers<B>,
    comm: &'a C,
    config: &'a ServeConfig,
    shape: AttnShape,
    /// The tree's merge (`None`: the ring).
    merge: Option<(MergeCollective, NodeLayout)>,
    caches: Vec<B::Kv>,
    books: Books,
    forward: Forward<B>,
    /// The decode attention of each of the last few batch sizes, the current one last, by
    /// its batch size: a size that comes back finds its buffers, and so its recorded pass,
    /// as it left them, its plan written over in place.
    decode: Kept<usize, RankAttention<'a, B, C>>,
    /// Whether the caches read through the decode layout's page table (a chunk installs its
    /// own).
    decode_table: bool,
    /// Where the rows that pad a decode step store their keys ([`ServeConfig::pad_slot`];
    /// `None`: steps are not padded, as the ring's are not).
    pad_slot: Option<u32>,
}

impl<'a, B: LayerOps, C: Collective + Transport<B>> Ranks<'a, B, C> {
    fn new(
        backend: &'a B,
        layers: &'a ModelLayers<B>,
        comm: &'a C,
        config: &'a ServeConfig,
    ) -> Result<Self> {
        let shape = layers.attn_shape();
        // The pools were priced by `LayerOps::check_model` before the weights were uploaded.
        let caches = (0..layers.num_layers())
            .map(|_| backend.alloc_kv(&shape, config.kv_dtype, config.pool_tokens()))
            .collect::<canopy_engine::Result<_>>()?;
        let merge = resolve_merge(
            config.strategy,
            comm,
            config.max_batch * shape.q_heads,
            shape.head_dim,
        )?;
        let room = if merge.is_some() { GROWTH_ROOM } else { 0 };
        let pad_slot = config.pad_slot().filter(|_| merge.is_some());
        Ok(Ranks {
            backend,
            layers,
            comm,
            config,
            shape,
            merge,
            caches,
            books: Books::new(comm.size(), config.page_size, config.pages_per_rank, room)?,
            forward: Forward::new().with_graphs(config.graphs),
            decode: Kept::new(),
            decode_table: false,
            pad_slot,
        })
    }

    fn run(&mut self, scheduler: &mut Option<Scheduler>) -> Result<()> {
        loop {
            let scheduling = Instant::now();
            let step = match scheduler.as_mut() {
                Some(s) => {
                    let step = s.next_step(&self.books);
                    step.send(self.comm)?;
                    step
                }
                None => Step::recv(self.comm)?,
            };
            let began = Instant::now();
            let mut failed = self.books.begin(&step);
            if step.stop {
                return Ok(());
            }
            if step.is_idle() {
                if let Some(s) = scheduler.as_mut() {
                    s.observe(&self.books, None, &[], failed, None);
                }
                continue;
            }
            let (rows, f) = self.books.decode(&step.decode);
            failed.extend(f);
            let wanted: Vec<Chunk> = step
                .prefill
                .iter()
                .filter(|c| !failed.iter().any(|(id, _)| *id == c.id))
                .copied()
                .collect();
            let (passes, unplaced) =
                self.books
                    .prefill_passes(&wanted, self.comm.rank(), Some(&rows));
            let mixed = passes.first().is_some_and(|p| p.decode_rows > 0);
            // Rank 0 draws: the other ranks read nothing beyond the narrowed rows.
            let reads = match scheduler {
                Some(_) => step_reads(&step, &rows.rows),
                None => RowReads::default(),
            };
            let mut decoded = None;
            let pass_began = Instant::now();
            if !rows.rows.is_empty() && !mixed {
                // The last step's tokens are told while the device runs this pass.
                let mut tell_told = || scheduler.as_mut().map_or((), Scheduler::tell_told);
                let (logits, kv_bytes) =
                    self.decode_pass(&rows, step.reach, &reads, &mut tell_told)?;
                decoded = Some((logits, Some((pass_began.elapsed().as_secs_f64(), kv_bytes))));
            } else if let Some(s) = scheduler.as_mut() {
                // No pass of decode rows to tell them beside: before the prompt chunks.
                s.tell_told();
            }
            let prefilling = Instant::now();
            let (chunks, mixed_logits) = self.prefill(passes, step.reach, &reads)?;
            for (id, _) in &unplaced {
                self.books.end(*id);
            }
            failed.extend(unplaced);
            let (mixed_rows, mixed_tensor) = mixed_logits.unzip();
            decoded = decoded.or(mixed_rows.map(|logits| (logits, None)));
            // Where the decode rows' logits are on the backend, to be read whole or walked.
            let pass_logits = mixed_tensor.as_ref().or(self.forward.logits());
            let backend = self.backend;
            let no_pass = || RuntimeError::Protocol("no pass's logits to read".into());
            let past = PastReads {
                read_whole: &|places| {
                    download_rows(backend, pass_logits.ok_or_else(no_pass)?, places)
                },
                walk_tails: &|walks| walk_tails(backend, pass_logits.ok_or_else(no_pass)?, walks),
            };
            let observing = Instant::now();
            if let Some(s) = scheduler.as_mut() {
                let decoded = decoded.as_ref().map(|(logits, cost)| Decoded {
                    rows: &rows,
                    logits,
                    cost: *cost,
                    past,
                });
                let clock = StepClock {
                    began,
                    prefill_seconds: prefilling.elapsed().as_secs_f64(),
                };
                s.observe(&self.books, decoded, &chunks, failed, Some(clock));
            }
            tracing::debug!(
                schedule_ms = ms(began - scheduling),
                books_ms = ms(pass_began - began),
                pass_ms = ms(prefilling - pass_began),
                prefill_ms = ms(observing - prefilling),
                observe_ms = ms(observing.elapsed()),
                "serve step"
            );
        }
    }

    /// The ranks whose KV views a decode pass plans over: this rank's for the tree, every
    /// rank's for the ring.
    fn viewers(&self) -> Vec<usize> {
        match self.merge {
            Some(_) => vec![self.comm.rank()],
            None => (0..self.comm.size()).collect(),
        }
    }

    /// The decode rows through every layer: their logits, in the rows' order, each narrowed to
    /// its `reach` most likely tokens (`None`: whole) and some rows read further (`reads`),
    /// and the distinct KV bytes their attention reads on this rank (every rank's shard, for
    /// the ring). `meanwhile` runs once the pass is launched, after the rows' softmax totals
    /// are queued behind it.
    fn decode_pass(
        &mut self,
        rows: &super::books::DecodeRows,
        reach: Option<usize>,
        reads: &RowReads,
        meanwhile: &mut dyn FnMut(),
    ) -> Result<(StepLogits, u64)> {
        let laying_out = Instant::now();
        let rank = self.comm.rank();
        let viewers = self.viewers();
        let batch = match self.pad_slot {
            Some(_) => {
                // The last decode step's size: its attention is the current one.
                let held = self.decode.last().map_or(0, |(b, _)| *b);
                held_batch(rows.ids.len(), held, self.config.max_batch)
            }
            None => rows.ids.len(),
        };
        let layout = self.books.layout(rank, &viewers)?;
        let fresh = matches!(layout, Layout::Fresh(_));
        match layout {
            // The tree only grew, so the rows, and their batch size, are the last step's.
            Layout::Grown { tails, new_pages } => {
                let (_, attention) = (self.decode.last_mut())
                    .filter(|(b, _)| **b == batch)
                    .ok_or_else(|| {
                        RuntimeError::Protocol(format!(
                            "a decode plan of {batch} rows grew before it was made"
                        ))
                    })?;
                attention.extend(&tails)?;
                self.decode_table &= !new_pages;
            }
            Layout::Fresh(views) => {
                self.plan_decode(&views, batch)?;
                self.decode_table = false;
            }
        }
        if !self.decode_table {
            let table = self.books.decode_table(rank).unwrap_or_default().to_vec();
            self.install(&table)?;
            self.decode_table = true;
        }
        let kv_bytes = self.books.queried_tokens(&viewers)
            * self.layers.num_layers() as u64
            * 2
            * self.shape.kv_token_bytes(self.config.kv_dtype) as u64;
        let pass = match self.pad_slot {
            Some(slot) => padded(rows, batch, rank, slot),
            None => PassRows {
                ids: Cow::Borrowed(&rows.ids),
                positions: Cow::Borrowed(&rows.positions),
                stores: mine(rows.placed.iter().map(Some), rank),
            },
        };
        let (_, attention) = self.decode.last_mut().expect("planned above");
        let replayed = self.forward.replayed();
        let decoding = Instant::now();
        let backend = self.backend;
        let mut totals = None;
        let mut while_running = |kept: &B::Tensor| -> Result<()> {
            totals = reads.queue_totals(backend, kept)?;
            meanwhile();
            Ok(())
        };
        let mut logits = self.forward.decode(
            backend,
            self.layers,
            &mut self.caches,
            attention,
            StepRows {
                ids: &pass.ids,
                positions: &pass.positions,
                stores: &pass.stores,
                reach,
            },
            &mut while_running,
        )?;
        let reading = Instant::now();
        if let Some(kept) = self.forward.logits() {
            reads.read(backend, kept, &mut logits, totals)?;
        }
        tracing::debug!(
            rows = rows.ids.len(),
            batch,
            layout_ms = ms(decoding - laying_out),
            decode_ms = ms(reading - decoding),
            reads_ms = ms(reading.elapsed()),
            fresh,
            replayed = self.forward.replayed() > replayed,
            "serve decode step"
        );
        Ok((logits, kv_bytes))
    }

    /// The step's prefill passes ([`Books::prefill_passes`]): each stored chunk, with the
    /// logits of its last row if it completes its prompt, and the logits of the decode rows
    /// that lead a pass, each narrowed to its `reach` most likely tokens (`None`: whole) and
    /// some read further (`reads`), beside the backend's tensor of them.
    #[allow(clippy::type_complexity)]
    fn prefill(
        &mut self,
        passes: Vec<PrefillPass>,
        reach: Option<usize>,
        reads: &RowReads,
    ) -> Result<(Vec<ChunkDone>, Option<(StepLogits, B::Tensor)>)> {
        let rank = self.comm.rank();
        let (backend, vocab) = (self.backend, self.layers.config.vocab_size);
        let mut done = Vec::new();
        let mut decoded = None;
        for pass in passes {
            let planning = Instant::now();
            let mut cached = match &pass.context {
                Some(view) => {
                    self.install(&view.table)?;
                    self.decode_table = false;
                    // A prompt pass is never recorded: its plan has its own rows alone.
                    Some(self.prefill_attention(view)?)
                }
                None => None,
            };
            let stores = mine(pass.placed.iter().map(Option::as_ref), rank);
            // Logits for the decode rows, and for the stored chunks that complete their
            // prompts.
            let completes: Vec<bool> = pass
                .chunks
                .iter()
                .map(|(c, _, stored)| {
                    *stored
                        && self
                            .books
                            .seq(c.id)
                            .is_some_and(|s| c.end as usize >= s.prompt.len())
                })
                .collect();
            let d = pass.decode_rows;
            let logit_rows: Vec<usize> = (0..d)
                .chain(
                    pass.chunks
                        .iter()
                        .zip(&completes)
                        .filter(|(_, &complete)| complete)
                        .map(|((_, rows, _), _)| rows.end - 1),
                )
                .collect();
            let ranges: Vec<_> = pass.chunks.iter().map(|(_, r, _)| r.clone()).collect();
            let launching = Instant::now();
            // Each row runs on the rank that stores its KV; a row stored nowhere (its
            // request failed to place it) on any.
            let ranks = self.comm.size();
            let owners: Vec<usize> = (pass.placed.iter().enumerate())
                .map(|(row, p)| p.map_or(row % ranks, |(r, _)| r))
                .collect();
            let x = prefill_chunks(
                backend,
                self.layers,
                &mut self.caches,
                self.comm,
                cached.as_mut(),
                ChunkPass {
                    rows: PrefillRows {
                        ids: &pass.ids,
                        positions: &pass.positions,
                        stores: &stores,
                    },
                    chunks: &ranges,
                    owners: &owners,
                },
            )?;
            let reading = Instant::now();
            let mut chunk_logits = Vec::new().into_iter();
            if !logit_rows.is_empty() {
                let mut logits = backend.tensor(logit_rows.len(), vocab)?;
                self.layers
                    .logits_into(backend, &x, &logit_rows, &mut logits)?;
                if logit_rows.len() > d {
                    let rest: Vec<usize> = (d..logit_rows.len()).collect();
                    let read = download_rows(backend, &logits, &rest)?;
                    chunk_logits = (read.rows().map(<[f32]>::to_vec))
                        .collect::<Vec<_>>()
                        .into_iter();
                }
                if d > 0 {
                    let mut rows = narrowed(backend, &logits, d, reach)?;
                    reads.read(backend, &logits, &mut rows, None)?;
                    decoded = Some((rows, logits));
                }
            }
            tracing::debug!(
                rows = pass.ids.len(),
                decode_rows = d,
                chunks = pass.chunks.len(),
                cached = cached.is_some(),
                plan_ms = ms(launching - planning),
                layers_ms = ms(reading - launching),
                logits_ms = ms(reading.elapsed()),
                "prefill pass"
            );
            for ((chunk, rows, stored), complete) in pass.chunks.into_iter().zip(completes) {
                if !stored {
                    continue;
                }
                let logits = if complete { chunk_logits.next() } else { None };
                let prompt_logprobs = match rank {
                    0 => self.prompt_logprobs(&x, &pass.positions, chunk.id, rows)?,
                    _ => Vec::new(),
                };
                self.books.chunk_done(chunk)?;
                done.push(ChunkDone {
                    chunk,
                    logits,
                    prompt_logprobs,
                });
            }
        }
        Ok((done, decoded))
    }

    /// The log-probabilities of the prompt tokens after `rows` of `x` (a pass's last hidden
    /// rows, at `positions`) where request `id` asks for them (else none): the prompt's next
    /// token after each row, with its likeliest tokens. A group of rows at a time, their logits
    /// are computed and reduced on the backend to what the host reads: each row's likeliest
    /// tokens, its log-normaliser and its next token's logit.
    fn prompt_logprobs(
        &self,
        x: &B::Tensor,
        positions: &[u32],
        id: u64,
        rows: Range<usize>,
    ) -> Result<Vec<TokenLogprobs>> {
        let Some(seq) = self.books.seq(id) else {
            return Ok(Vec::new());
        };
        let Some(top) = seq.prompt_logprobs.map(|n| n as usize) else {
            return Ok(Vec::new());
        };
        // Row `r` predicts the prompt's token after its own position.
        let next = |r: usize| seq.prompt.get(positions[r] as usize + 1).map(|&t| (r, t));
        let wanted: Vec<(usize, u32)> = rows.filter_map(next).collect();
        let (backend, vocab) = (self.backend, self.layers.config.vocab_size);
        let mut out = Vec::with_capacity(wanted.len());
        for group in wanted.chunks(PROMPT_LOGITS_ROWS) {
            let (read, targets): (Vec<usize>, Vec<u32>) = group.iter().copied().unzip();
            let mut logits = backend.output_tensor(read.len(), vocab)?;
            self.layers.logits_into(backend, x, &read, &mut logits)?;
            let terms = row_terms(backend, &logits, top, &targets)?;
            out.extend(terms.iter().map(|(t, logit)| t.logprobs(*logit, top)));
        }
        Ok(out)
    }

    /// The plan of a rank's `view` over `batch` queries (at least its own): its rows', then
    /// the padding rows', which have no keys.
    fn plan_of(&self, view: &RankSnapshot, batch: usize) -> Result<canopy_core::Plan> {
        let shard = Shard::whole(&view.tree);
        let cfg = PlannerConfig::default();
        let tree = TreeView::new(&view.tree, &shard);
        Ok(plan(&tree, self.config.method, &self.shape, &cfg)?.with_queries(batch))
    }

    /// Makes the decode attention of `batch` rows the current one, planned over `views`. The
    /// tree's is written over in place where one of that size is kept (a recorded pass of it
    /// still replays if the plan fits its buffers), else made, pushing out the least recently
    /// used size's ([`Kept`]). The ring's is made anew, and is the only one kept: its
    /// receive buffers are as large as the shards.
    fn plan_decode(&mut self, views: &[RankSnapshot], batch: usize) -> Result<()> {
        let attention = match (self.decode.take(&batch), &self.merge) {
            (Some(mut attention), Some(_)) => {
                attention.replan(&self.plan_of(&views[0], batch)?)?;
                attention
            }
            // The buffers it replaces go before the new ones are made.
            (None, Some(_)) => {
                self.decode.make_room();
                self.attention(views, batch)?
            }
            (_, None) => {
                self.decode.clear();
                self.attention(views, batch)?
            }
        };
        self.decode.push(batch, attention);
        Ok(())
    }

    /// A prefill pass's attention over this rank's `view`, on a ring server too: its rank-local
    /// states merge across the ranks in the pass (`prefill_chunks`), whose rows meet across the
    /// ranks at every layer anyway; passing every shard around the ring would attend every row
    /// to every shard on every rank.
    fn prefill_attention(&self, view: &RankSnapshot) -> Result<RankAttention<'a, B, C>> {
        let plan = self.plan_of(view, 0)?;
        Ok(RankAttention::local(
            self.backend,
            self.comm,
            self.shape,
            &plan,
        )?)
    }

    /// A rank's decode attention over `views` (this rank's for the tree, every rank's for the
    /// ring) for `batch` rows.
    fn attention(&self, views: &[RankSnapshot], batch: usize) -> Result<RankAttention<'a, B, C>> {
        let plan_of = |v: &RankSnapshot| self.plan_of(v, batch);
        Ok(match &self.merge {
            Some((how, layout)) => RankAttention::tree(
                self.backend,
                self.comm,
                self.shape,
                &plan_of(&views[0])?,
                *how,
                layout.clone(),
            )?,
            None => RankAttention::ring(
                self.backend,
                self.comm,
                self.shape,
                self.config.kv_dtype,
                views
                    .iter()
                    .map(|v| {
                        Ok(RingShard {
                            plan: plan_of(v)?,
                            tokens: v.table.len() * self.config.page_size as usize,
                        })
                    })
                    .collect::<Result<_>>()?,
            )?,
        })
    }

    /// Every layer's cache reads through `table` from now on.
    fn install(&mut self, table: &[u32]) -> Result<()> {
        let page_size = self.config.page_size;
        Ok(self
            .backend
            .set_page_tables(&mut self.caches, page_size, table)?)
    }
}

/// The first `rows` rows of `logits` on the host, each narrowed to its `reach` most likely
/// tokens (`None`: whole).
fn narrowed<B: LayerOps>(
    backend: &B,
    logits: &B::Tensor,
    rows: usize,
    reach: Option<usize>,
) -> Result<StepLogits> {
    let (all, vocab) = backend.dims(logits);
    let copied = if rows < all {
        let mut head = backend.tensor(rows, vocab)?;
        backend.copy_rows(logits, 0, &mut head)?;
        Some(head)
    } else {
        None
    };
    let head = copied.as_ref().unwrap_or(logits);
    Ok(match reach {
        Some(k) => {
            let k = k.min(vocab);
            let mut top = backend.tensor(rows, 2 * k)?;
            backend.top_logits(head, k, &mut top)?;
            StepLogits::top(k, backend.download_tensor(&top)?)
        }
        None => StepLogits::Whole {
            vocab,
            logits: backend.download_tensor(head)?,
        },
    })
}

/// The decode rows of `step` read beyond their narrowed form, by their place among `rows`.
fn step_reads(step: &Step, rows: &[Row]) -> RowReads {
    let place = |listed: &(u64, u32)| (rows.iter()).position(|r| (r.id, r.sample) == *listed);
    let places = |listed: &[(u64, u32)]| {
        let mut places: Vec<usize> = listed.iter().filter_map(place).collect();
        places.sort_unstable();
        places
    };
    RowReads {
        whole: places(&step.whole),
        terms: places(&step.terms),
        totals: (step.totals.iter())
            .filter_map(|(listed, t)| place(listed).map(|p| (p, *t)))
            .collect(),
        picks: (step.picks.iter())
            .filter_map(|(listed, picks)| place(listed).map(|p| (p, picks.clone())))
            .collect(),
    }
}

/// A decode pass's rows as the layers take them: each row's token and position, and the rows
/// whose keys this rank stores, `(row, physical slot)`.
struct PassRows<'r> {
    ids: Cow<'r, [u32]>,
    positions: Cow<'r, [u32]>,
    stores: Vec<(u32, u32)>,
}

/// The decode rows padded to `batch` rows: token 0 at position 0 for the padding, and every
/// row's key stored on this rank, at its own slot where this rank holds the row, else at
/// `pad_slot`, so that every step of a batch size stores as many keys on every rank.
fn padded(
    rows: &super::books::DecodeRows,
    batch: usize,
    rank: usize,
    pad_slot: u32,
) -> PassRows<'static> {
    let pad = |v: &[u32]| {
        let mut v = v.to_vec();
        v.resize(batch, 0);
        Cow::Owned(v)
    };
    let stores = (0..batch)
        .map(|row| match rows.placed.get(row) {
            Some(&(r, slot)) if r == rank => (row as u32, slot),
            _ => (row as u32, pad_slot),
        })
        .collect();
    PassRows {
        ids: pad(&rows.ids),
        positions: pad(&rows.positions),
        stores,
    }
}

/// The rows whose KV this rank stores, `(row, physical slot)`, of the rows' `(rank, slot)`
/// places (`None`: stored nowhere).
fn mine<'p>(
    placed: impl Iterator<Item = Option<&'p (usize, u32)>>,
    rank: usize,
) -> Vec<(u32, u32)> {
    placed
        .enumerate()
        .filter_map(|(row, p)| match p {
            Some(&(r, slot)) if r == rank => Some((row as u32, slot)),
            _ => None,
        })
        .collect()
}
