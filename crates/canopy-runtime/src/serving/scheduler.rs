//! Rank 0's scheduler: it owns the batch. Before each step it takes the handles' commands,
//! drops requests whose clients have gone, admits waiting requests first come first served
//! while the batch has rows and the KV cache has pages for them, and describes the step; after
//! it, it draws each row's token and tells each request's client.
//!
//! **Pages.** A request is admitted only if every running request can still take all the
//! pages it may need (its prompt's rest, each sample's `max_tokens`) from the free and
//! evictable pages, so no request runs out of KV half-way; a request that fits the cache alone
//! (checked at submission) is always admitted once the batch is empty.
//!
//! **Shared prefixes in flight.** A prompt enters the prefix cache when its last chunk is
//! prefilled. A waiting request that shares at least one more whole page with a prompt still
//! being prefilled than with the cache waits for it (requests behind it may pass), then reads
//! that prefix from the cache instead of computing and holding a copy of its own: requests
//! that arrive together behind one long prompt share it from their first step.

use super::books::{Books, DecodeRows};
use super::handle::{
    Command, EngineInbox, EngineStatus, Event, FinishReason, Limits, ServeRequest, Submitted,
};
use super::step::{Admit, Chunk, Row, Step};
use super::stop::StopText;
use crate::sampling::{step_reach, RowLogits, Sampler, StepLogits, TokenLogprobs, LOGPROBS_MAX};
use crate::RuntimeError;
use canopy_engine::TOP_LOGITS_MAX;
use canopy_model::{IncrementalDecoder, Tokenizer};
use draw::DrawRow;
pub(crate) use draw::PastReads;
use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

mod draw;
mod tell;

/// How long an idle engine waits for a command before a heartbeat step (which keeps the other
/// ranks from timing out while the server has no requests).
const HEARTBEAT: Duration = Duration::from_secs(2);

/// A request's `prompt_logprobs` as a step says it.
fn prompt_logprobs(r: &ServeRequest) -> Option<u32> {
    r.prompt_logprobs.map(|n| n.min(LOGPROBS_MAX) as u32)
}

/// One sample of a running request.
struct Sample<'t> {
    sampler: Sampler,
    decoder: IncrementalDecoder<'t>,
    text: StopText,
    drawn: usize,
    /// The token it decodes at the next step (`None` before its first or after its last).
    next: Option<u32>,
    done: bool,
}

/// An admitted request, as rank 0 serves it.
struct Running<'t> {
    submitted: Submitted,
    samples: Vec<Sample<'t>>,
    /// Prompt tokens whose KV is stored (or found cached).
    prefilled: usize,
}

impl Running<'_> {
    fn prompt_len(&self) -> usize {
        self.submitted.request.prompt.len()
    }

    fn send(&mut self, event: Event) -> bool {
        self.submitted.request.sink.send(event)
    }

    /// Pages this request may still take.
    fn pages_to_come(&self, limits: &Limits) -> usize {
        let r = &self.submitted.request;
        if self.prefilled < self.prompt_len() {
            return limits.pages(self.prompt_len(), self.prefilled, r.max_tokens, r.samples);
        }
        let ps = limits.page_size;
        self.samples
            .iter()
            .filter(|s| !s.done)
            .map(|s| (r.max_tokens - s.drawn).div_ceil(ps) + 1)
            .sum()
    }
}

/// When a step that computed something began on rank 0 (after its description was sent),
/// and the seconds its prompt chunks took.
pub(crate) struct StepClock {
    pub began: Instant,
    pub prefill_seconds: f64,
}

/// A prompt chunk stored in a step: the logits of its last row where it completes its
/// prompt, and the log-probabilities of the prompt tokens after its rows where its request
/// asks for them.
pub(crate) struct ChunkDone {
    pub chunk: Chunk,
    pub logits: Option<Vec<f32>>,
    pub prompt_logprobs: Vec<TokenLogprobs>,
}

/// One decode pass as the scheduler sees it.
pub(crate) struct Decoded<'a> {
    pub rows: &'a DecodeRows,
    pub logits: &'a StepLogits,
    /// The pass's seconds and distinct KV bytes read (see
    /// [`DecodePasses`](super::handle::DecodePasses)); `None` when the rows ran in a prefill
    /// pass, whose time counts as prefill.
    pub cost: Option<(f64, u64)>,
    /// The pass's rows on the backend, by their places among `rows`, for draws that land past
    /// their narrowed rows.
    pub past: PastReads<'a>,
}

pub(crate) struct Scheduler<'t> {
    inbox: EngineInbox,
    tokenizer: &'t Tokenizer,
    /// Tokens that end a sample (the model's end-of-sequence ids).
    stop_tokens: Vec<u32>,
    limits: Limits,
    max_batch: usize,
    prefill_chunk: usize,
    waiting: VecDeque<Submitted>,
    /// By id: the order of arrival.
    running: BTreeMap<u64, Running<'t>>,
    /// Requests to end at the next step (finished, cancelled, or their client gone).
    ending: Vec<u64>,
    /// Samples that ended while their request goes on, to end at the next step.
    ended_samples: Vec<(u64, u32)>,
    /// Drawn tokens not yet told to their clients ([`Scheduler::tell_told`]), and the requests
    /// they ended, kept until then.
    told: Vec<tell::Told>,
    finishing: BTreeMap<u64, Running<'t>>,
    draining: bool,
    status: EngineStatus,
}

impl<'t> Scheduler<'t> {
    pub fn new(
        inbox: EngineInbox,
        tokenizer: &'t Tokenizer,
        stop_tokens: Vec<u32>,
        limits: Limits,
        prefill_chunk: usize,
    ) -> Scheduler<'t> {
        Scheduler {
            inbox,
            tokenizer,
            stop_tokens,
            limits,
            max_batch: limits.max_samples,
            prefill_chunk: prefill_chunk.max(1),
            waiting: VecDeque::new(),
            running: BTreeMap::new(),
            ending: Vec::new(),
            ended_samples: Vec::new(),
            told: Vec::new(),
            finishing: BTreeMap::new(),
            draining: false,
            status: EngineStatus::default(),
        }
    }

    /// The next step: commands taken (waiting for one while there is nothing to do), gone
    /// clients dropped, requests ended and admitted, rows and chunks chosen.
    pub fn next_step(&mut self, books: &Books) -> Step {
        let idle = self.running.is_empty() && self.waiting.is_empty() && self.ending.is_empty();
        let mut wait = (idle && !self.draining).then_some(HEARTBEAT);
        if wait.is_some() {
            self.tell_told();
        }
        while let Some(command) = self.inbox.next(wait.take()) {
            self.command(command);
        }
        let gone: Vec<u64> = self
            .running
            .iter()
            .filter(|(_, r)| r.submitted.request.sink.is_closed())
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            self.cancel(id);
        }
        let before = self.waiting.len();
        self.waiting.retain(|s| !s.request.sink.is_closed());
        for _ in self.waiting.len()..before {
            self.inbox.dequeued();
        }

        let mut step = Step {
            end: std::mem::take(&mut self.ending),
            end_samples: std::mem::take(&mut self.ended_samples),
            ..Step::default()
        };
        self.admit(books, &mut step);
        for (&id, r) in &self.running {
            for (i, s) in r.samples.iter().enumerate() {
                if let Some(token) = s.next {
                    step.decode.push(Row {
                        id,
                        sample: i as u32,
                        token,
                    });
                }
            }
        }
        // Each row's reach, once: narrowed to its likeliest tokens, or `None`, read whole.
        let reaches: Vec<Option<usize>> = (step.decode.iter())
            .map(|row| {
                let sampler = &self.running[&row.id].samples[row.sample as usize].sampler;
                sampler.reach().filter(|&k| k <= TOP_LOGITS_MAX)
            })
            .collect();
        // Rows that all need their whole logits are read whole at once.
        let all_whole = !reaches.is_empty() && reaches.iter().all(Option::is_none);
        step.reach = match all_whole {
            true => None,
            false => step_reach(reaches.iter().flatten().map(|&k| Some(k)), 1),
        };
        // A narrowed row that reports its token's log-probability has its row's
        // log-normaliser and likeliest tokens read beside it, one drawn over the whole
        // vocabulary its softmax total, and one whose draw changes logits those logits.
        if step.reach.is_some() {
            for (row, reach) in step.decode.iter().zip(&reaches) {
                let place = (row.id, row.sample);
                let r = &self.running[&row.id];
                if reach.is_none() {
                    step.whole.push(place);
                    continue;
                }
                if r.submitted.request.logprobs.is_some() {
                    step.terms.push(place);
                }
                let sampler = &r.samples[row.sample as usize].sampler;
                if let Some(t) = sampler.total_temperature() {
                    step.totals.push((place, t));
                }
                let picks = sampler.picks();
                if !picks.is_empty() {
                    step.picks.push((place, picks));
                }
            }
        }
        let mut budget = self.prefill_chunk;
        for (&id, r) in &self.running {
            if budget == 0 {
                break;
            }
            if r.prefilled < r.prompt_len() {
                let end = r.prompt_len().min(r.prefilled + budget);
                budget -= end - r.prefilled;
                step.prefill.push(Chunk {
                    id,
                    end: end as u32,
                });
            }
        }
        step.stop = self.draining && self.running.is_empty() && self.waiting.is_empty();
        if step.stop {
            self.tell_told();
        }
        step
    }

    fn command(&mut self, command: Command) {
        match command {
            Command::Submit(s) => self.waiting.push_back(s),
            Command::Cancel(id) => {
                if let Some(at) = self.waiting.iter().position(|s| s.id == id) {
                    self.waiting.remove(at);
                    self.inbox.dequeued();
                }
                self.cancel(id);
            }
            Command::Drain => self.draining = true,
        }
    }

    /// Ends a running request at the next step, without telling its client more.
    fn cancel(&mut self, id: u64) {
        if self.running.remove(&id).is_some() {
            self.ending.push(id);
        }
    }

    /// Admits waiting requests, first come first served, while rows and pages allow; one
    /// whose prefix is being prefilled for another waits for it (see the module's notes).
    fn admit(&mut self, books: &Books, step: &mut Step) {
        let cache = books.cache();
        let available = cache.available_pages();
        let mut rows: usize = self
            .running
            .values()
            .map(|r| r.samples.iter().filter(|s| !s.done).count())
            .sum();
        let mut committed: usize = self
            .running
            .values()
            .map(|r| r.pages_to_come(&self.limits))
            .sum();
        let mut at = 0;
        while let Some(next) = self.waiting.get(at) {
            let r = &next.request;
            let reusable = Admit::reusable(&r.prompt, prompt_logprobs(r));
            let cached = cache.cached_len(reusable);
            if self.prefilling_extends(reusable, cached) {
                at += 1;
                continue;
            }
            let pages = self
                .limits
                .pages(r.prompt.len(), cached, r.max_tokens, r.samples)
                + cached.div_ceil(self.limits.page_size);
            let first = self.running.is_empty() && step.admit.is_empty();
            if !first && (rows + r.samples > self.max_batch || committed + pages > available) {
                break;
            }
            rows += r.samples;
            committed += pages;
            let submitted = self.waiting.remove(at).expect("a waiting request");
            self.inbox.dequeued();
            self.start(submitted, cached, step);
        }
    }

    /// Whether a running prompt still being prefilled will cache the whole page of `reusable`
    /// after its `cached` tokens (it then caches every page it shares with `reusable`).
    fn prefilling_extends(&self, reusable: &[u32], cached: usize) -> bool {
        let next = cached + self.limits.page_size;
        let Some(page) = reusable.get(cached..next) else {
            return false;
        };
        self.running.values().any(|r| {
            let prompt = &r.submitted.request.prompt;
            // Its whole pages are cached when its last chunk is done.
            r.prefilled < prompt.len()
                && prompt.len() >= next
                && prompt[cached..next] == *page
                && prompt[..cached] == reusable[..cached]
        })
    }

    fn start(&mut self, submitted: Submitted, cached: usize, step: &mut Step) {
        let r = &submitted.request;
        step.admit.push(Admit {
            id: submitted.id,
            prompt: r.prompt.clone(),
            samples: r.samples as u32,
            prompt_logprobs: prompt_logprobs(r),
        });
        let samples = (0..r.samples)
            .map(|i| Sample {
                sampler: Sampler::new(r.sampling, r.seed.wrapping_add(i as u64), &r.prompt)
                    .with_bias(&r.logit_bias),
                decoder: self.tokenizer.incremental_decoder(true),
                text: StopText::default(),
                drawn: 0,
                next: None,
                done: false,
            })
            .collect();
        let id = submitted.id;
        let mut running = Running {
            submitted,
            samples,
            prefilled: cached,
        };
        if running.send(Event::Started {
            cached_tokens: cached,
        }) {
            self.running.insert(id, running);
        } else {
            self.ending.push(id);
        }
    }

    /// What the step computed: the decode pass (each row's logits in the rows' order, and
    /// what the pass cost), each stored chunk with its last row's logits if it completes its
    /// prompt, the requests that
    /// failed (already out of the books), and the step's clock (`None` for a step that
    /// computed nothing).
    pub fn observe(
        &mut self,
        books: &Books,
        decoded: Option<Decoded<'_>>,
        chunks: &[ChunkDone],
        failed: Vec<(u64, RuntimeError)>,
        clock: Option<StepClock>,
    ) {
        // The last step's tokens go out before anything of this one.
        self.tell_told();
        for (id, e) in failed {
            if let Some(mut r) = self.running.remove(&id) {
                r.send(Event::Failed(e.to_string()));
            }
        }
        // The rows to draw: each decode row, then each sample of a prompt completed.
        let mut rows: Vec<DrawRow> = Vec::new();
        if let Some(d) = &decoded {
            let decode = &d.rows.rows;
            self.status.batch = decode.len();
            if let Some((seconds, kv_bytes)) = d.cost {
                self.status
                    .decode
                    .entry(decode.len())
                    .or_default()
                    .add(seconds, kv_bytes);
            }
            rows.extend((decode.iter().enumerate()).map(|(i, row)| DrawRow {
                id: row.id,
                sample: row.sample as usize,
                logits: d.logits.row(i),
                terms: d.logits.terms(i),
                total: d.logits.total(i),
                place: Some(i),
            }));
        } else {
            self.status.batch = 0;
        }
        for done in chunks {
            let (chunk, logits) = (&done.chunk, &done.logits);
            let Some(r) = self.running.get_mut(&chunk.id) else {
                continue;
            };
            if !done.prompt_logprobs.is_empty() {
                let logprobs = done.prompt_logprobs.clone();
                if !r.send(Event::PromptLogprobs {
                    sample: 0,
                    logprobs,
                }) {
                    self.cancel(chunk.id);
                    continue;
                }
            }
            let before = r.prefilled;
            r.prefilled = books.seq(chunk.id).map_or(r.prefilled, |s| s.computed);
            self.status.prefill_tokens += (r.prefilled - before) as u64;
            if r.prefilled == r.prompt_len() && r.submitted.request.max_tokens == 0 {
                // A prompt scored for its own tokens draws none: it ends here.
                for sample in 0..r.samples.len() {
                    r.send(Event::Finished {
                        sample,
                        reason: FinishReason::Length,
                        text: String::new(),
                    });
                }
                self.running.remove(&chunk.id);
                self.ending.push(chunk.id);
                continue;
            }
            if let (true, Some(logits)) = (r.prefilled == r.prompt_len(), logits) {
                rows.extend((0..r.samples.len()).map(|sample| DrawRow {
                    id: chunk.id,
                    sample,
                    logits: RowLogits::Whole(logits),
                    terms: None,
                    total: None,
                    place: None,
                }));
            }
        }
        let drawn = self.draw_rows(&rows, decoded.as_ref().map(|d| d.past));
        for (row, drawn) in rows.iter().zip(drawn) {
            if let Some((token, logprobs)) = drawn {
                self.tell(row.id, row.sample, token, logprobs);
            }
        }
        if let Some(c) = clock {
            self.status.busy_steps += 1;
            self.status.busy_seconds += c.began.elapsed().as_secs_f64();
            self.status.prefill_seconds += c.prefill_seconds;
        }
        self.publish(books);
    }

    fn publish(&mut self, books: &Books) {
        let cache = books.cache();
        let stats = cache.stats();
        let st = &mut self.status;
        st.waiting = self.waiting.len();
        // A request ended since the last step still holds its pages until the next one frees
        // them: it counts as running until then, so `running == 0` means the pages are back.
        st.running = self.running.len() + self.ending.len();
        st.pages_used = cache.kv().pages_in_use();
        st.pages_free = cache.kv().pages_free();
        st.pages_cached = cache.evictable_pages();
        st.prefix_queried_tokens = stats.queried_tokens;
        st.prefix_hit_tokens = stats.hit_tokens;
        st.steps += 1;
        self.inbox.publish(st.clone());
    }

    /// The engine stopped on `error`: every request ends with it and no new one is taken.
    pub fn fail_all(&mut self, error: &RuntimeError) {
        self.inbox.close();
        let message = format!("the engine stopped: {error}");
        for (_, mut r) in std::mem::take(&mut self.running) {
            r.send(Event::Failed(message.clone()));
        }
        while let Some(mut s) = self.waiting.pop_front() {
            s.request.sink.send(Event::Failed(message.clone()));
        }
        while let Some(command) = self.inbox.next(None) {
            if let Command::Submit(mut s) = command {
                s.request.sink.send(Event::Failed(message.clone()));
            }
        }
        self.status.failure = Some(message);
        self.inbox.publish(self.status.clone());
    }

    /// The engine stopped after draining: no new request is taken; the status shows the
    /// books as the last step left them.
    pub fn close(&mut self, books: &Books) {
        self.inbox.close();
        self.publish(books);
    }
}

#[cfg(test)]
mod tests;
