//! The engine's front door: what a server's threads hand it and get back.
//!
//! A request is checked against the engine's [`Limits`] when it is submitted, so a client
//! learns at once that it can never run; one that can waits in a bounded queue. Its tokens
//! come back through its [`EventSink`], which also tells the engine when the client has gone
//! (the request is then cancelled and its pages freed).

#[cfg(doc)]
use crate::sampling::LOGPROBS_MAX;
use crate::sampling::{SamplingParams, TokenLogprobs};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// One client request: a prompt and how to continue it.
pub struct ServeRequest {
    pub prompt: Vec<u32>,
    /// New tokens per sample, at most; 0 (with `prompt_logprobs`) draws none, and the request
    /// ends once its prompt is computed.
    pub max_tokens: usize,
    /// Samples of the prompt, decoded as branches of one tree; sample `i` draws from
    /// `seed + i`.
    pub samples: usize,
    pub sampling: SamplingParams,
    pub seed: u64,
    /// Texts that end a sample; its text stops before the first one found.
    pub stop: Vec<String>,
    /// Draw past the model's end-of-sequence tokens (stop strings still end a sample): every
    /// sample runs to `max_tokens`, as a benchmark needs of a model whose EOS comes at random.
    pub ignore_eos: bool,
    /// Report each drawn token's log-probability with this many of the most likely tokens
    /// beside it (at most [`LOGPROBS_MAX`]; `None`: none). A step with such a request reads
    /// its rows' whole logits from the backend.
    pub logprobs: Option<usize>,
    /// Report each prompt token's log-probability (from the second on) with this many of the
    /// most likely tokens beside it (at most [`LOGPROBS_MAX`]; `None`: none). Such a prompt is
    /// computed whole, never read from the prefix cache, and its rows' logits are read.
    pub prompt_logprobs: Option<usize>,
    /// Added to these tokens' logits before each draw (OpenAI's `logit_bias`).
    pub logit_bias: Vec<(u32, f32)>,
    /// Where the request's events go.
    pub sink: Box<dyn EventSink>,
}

/// What happens to a request, in order: `Started`, then per sample its `Token`s and one
/// `Finished`; or `Failed` at any point, which ends every sample.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// The request was admitted; `cached_tokens` of its prompt were found in the prefix cache.
    Started { cached_tokens: usize },
    /// The log-probabilities of the next prompt tokens, in order from the prompt's second, as
    /// a chunk of the prompt is computed (before the first `Token`; `sample` is 0, the first
    /// of the prompt's samples, which a sink may number otherwise).
    PromptLogprobs {
        sample: usize,
        logprobs: Vec<TokenLogprobs>,
    },
    /// A token of a sample and the text it completes (empty while a character or a possible
    /// stop string is unfinished).
    Token {
        sample: usize,
        token: u32,
        text: String,
        /// The token's log-probability, if the request asked for them.
        logprobs: Option<TokenLogprobs>,
    },
    /// A sample ended; `text` is what it held back, now released.
    Finished {
        sample: usize,
        reason: FinishReason,
        text: String,
    },
    /// The engine could not run the request.
    Failed(String),
}

/// Why a sample ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token or a stop string.
    Stop,
    /// `max_tokens`.
    Length,
}

impl FinishReason {
    /// The name OpenAI's API gives it.
    pub fn name(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// Where a request's events go: a server's connection to its client.
pub trait EventSink: Send {
    /// Delivers an event; `false` when the client is gone, which cancels the request.
    fn send(&mut self, event: Event) -> bool;
    /// Whether the client is gone (checked between steps, also for waiting requests).
    fn is_closed(&self) -> bool;
}

/// Why a request was refused before it ran.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    #[error("the prompt is empty; give at least one token of text")]
    EmptyPrompt,
    #[error(
        "max_tokens must be at least 1 (0 only where the prompt's own log-probabilities are \
         asked for: echo with logprobs)"
    )]
    NoTokens,
    #[error("n must be between 1 and {max}, the server's batch (--max-batch)")]
    Samples { max: usize },
    #[error(
        "this server's maximum context length is {max_context} tokens, but the request has \
         {prompt} prompt tokens and max_tokens {max_tokens} ({}); shorten the prompt or lower \
         max_tokens",
        prompt + max_tokens
    )]
    TooLong {
        prompt: usize,
        max_tokens: usize,
        max_context: usize,
    },
    #[error(
        "the request needs {need} KV pages ({tokens} tokens over {samples} samples) but the \
         server's KV cache holds {pages}; lower max_tokens or n"
    )]
    TooBig {
        need: usize,
        tokens: usize,
        samples: usize,
        pages: usize,
    },
    #[error("the queue is full ({queued} requests waiting); retry later")]
    QueueFull { queued: usize },
    #[error("the server is shutting down")]
    Stopped,
}

/// What one request may ask of the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Prompt tokens plus `max_tokens`, at most.
    pub max_context: usize,
    /// Samples of one request (the batch's rows), at most.
    pub max_samples: usize,
    pub page_size: usize,
    /// Pages of every rank's pool together.
    pub pages: usize,
}

impl Limits {
    /// The pages a request takes at most beyond the `cached` tokens of its prompt found in the
    /// cache: its prompt's rest (and the partial page it ends in), then each sample's tokens
    /// on pages of their own.
    pub fn pages(&self, prompt: usize, cached: usize, max_tokens: usize, samples: usize) -> usize {
        let ps = self.page_size;
        (prompt - cached).div_ceil(ps) + 1 + samples * (max_tokens.div_ceil(ps) + 1)
    }

    /// Refuses a request that could never run here.
    pub fn check(
        &self,
        prompt: usize,
        max_tokens: usize,
        samples: usize,
    ) -> Result<(), RequestError> {
        if prompt == 0 {
            return Err(RequestError::EmptyPrompt);
        }
        if samples == 0 || samples > self.max_samples {
            return Err(RequestError::Samples {
                max: self.max_samples,
            });
        }
        if prompt + max_tokens > self.max_context {
            return Err(RequestError::TooLong {
                prompt,
                max_tokens,
                max_context: self.max_context,
            });
        }
        let need = self.pages(prompt, 0, max_tokens, samples);
        if need > self.pages {
            return Err(RequestError::TooBig {
                need,
                tokens: prompt + samples * max_tokens,
                samples,
                pages: self.pages,
            });
        }
        Ok(())
    }
}

/// The engine's state after its last step, for health checks and metrics.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineStatus {
    /// Requests waiting for admission.
    pub waiting: usize,
    /// Requests admitted whose pages are not yet released (ended ones count until the next
    /// step frees them).
    pub running: usize,
    /// Sample rows decoded in the last step.
    pub batch: usize,
    pub pages_used: usize,
    pub pages_free: usize,
    /// Pages of cached prefixes no request references (evictable).
    pub pages_cached: usize,
    /// Prompt tokens looked up in the prefix cache, and of those found there.
    pub prefix_queried_tokens: u64,
    pub prefix_hit_tokens: u64,
    /// Prompt tokens computed (not found in the cache).
    pub prefill_tokens: u64,
    /// Seconds of the prompt chunks' passes on rank 0.
    pub prefill_seconds: f64,
    /// Steps that computed something, and their seconds on rank 0 from the step's description
    /// to its tokens sent: the decode pass, the prompt chunks, and the books, sampling and
    /// text around them.
    pub busy_steps: u64,
    pub busy_seconds: f64,
    /// Tokens drawn, over all samples.
    pub generated_tokens: u64,
    /// Decode rows whose whole logits came to the host for their draws: rows a step read
    /// whole, and draws by total that landed past their narrowed rows and needed them.
    pub rows_read_whole: u64,
    /// Draws by total that landed past their narrowed rows and went on over the rest of
    /// their rows on the backend.
    pub rows_tail_walked: u64,
    pub steps: u64,
    /// The decode passes so far, by their rows.
    pub decode: BTreeMap<usize, DecodePasses>,
    /// Set when the engine stopped on an error.
    pub failure: Option<String>,
}

/// Decode passes of one batch size, summed: what a pass costs, and the least it must read.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DecodePasses {
    pub passes: u64,
    /// Seconds on rank 0 from the pass's layout (planned afresh or extended) to its logits on
    /// the host; prompt chunks of the same step are not in it.
    pub seconds: f64,
    /// The distinct KV bytes the passes' attention had to read on rank 0 (every layer's K and
    /// V of each token on some row's path, once): a plan that reads a shared prefix once per
    /// row reads more, none reads less.
    pub kv_bytes: u64,
}

impl DecodePasses {
    pub fn add(&mut self, seconds: f64, kv_bytes: u64) {
        self.passes += 1;
        self.seconds += seconds;
        self.kv_bytes += kv_bytes;
    }
}

/// A request as the engine receives it.
pub(crate) struct Submitted {
    pub id: u64,
    pub request: ServeRequest,
}

pub(crate) enum Command {
    Submit(Submitted),
    Cancel(u64),
    /// Finish the running and waiting requests, then stop.
    Drain,
}

/// What the handles and the engine share.
struct Shared {
    limits: Limits,
    queue: usize,
    /// Requests submitted and not yet admitted or dropped.
    queued: AtomicUsize,
    next_id: AtomicU64,
    draining: AtomicBool,
    status: Mutex<EngineStatus>,
}

/// A server's side of the engine: cheap to clone, one per connection if need be.
#[derive(Clone)]
pub struct EngineHandle {
    tx: Sender<Command>,
    shared: Arc<Shared>,
}

/// Rank 0's side: the commands of every handle, in order.
pub struct EngineInbox {
    rx: Receiver<Command>,
    shared: Arc<Shared>,
}

/// An engine's handle and inbox; at most `queue` requests wait for admission at once.
pub fn channel(limits: Limits, queue: usize) -> (EngineHandle, EngineInbox) {
    let (tx, rx) = std::sync::mpsc::channel();
    let shared = Arc::new(Shared {
        limits,
        queue,
        queued: AtomicUsize::new(0),
        next_id: AtomicU64::new(0),
        draining: AtomicBool::new(false),
        status: Mutex::new(EngineStatus::default()),
    });
    (
        EngineHandle {
            tx,
            shared: shared.clone(),
        },
        EngineInbox { rx, shared },
    )
}

impl EngineHandle {
    pub fn limits(&self) -> Limits {
        self.shared.limits
    }

    /// Requests that may wait for admission at once.
    pub fn queue_capacity(&self) -> usize {
        self.shared.queue
    }

    /// Queues `request` unless it could never run, the queue is full or the engine is
    /// draining; returns its id, for [`cancel`](Self::cancel).
    pub fn submit(&self, request: ServeRequest) -> Result<u64, RequestError> {
        let s = &self.shared;
        if s.draining.load(Ordering::SeqCst) {
            return Err(RequestError::Stopped);
        }
        s.limits
            .check(request.prompt.len(), request.max_tokens, request.samples)?;
        // A prompt scored for its own tokens may draw none.
        if request.max_tokens == 0 && request.prompt_logprobs.is_none() {
            return Err(RequestError::NoTokens);
        }
        let queued = s.queued.fetch_add(1, Ordering::SeqCst);
        if queued >= s.queue {
            s.queued.fetch_sub(1, Ordering::SeqCst);
            return Err(RequestError::QueueFull { queued });
        }
        let id = s.next_id.fetch_add(1, Ordering::SeqCst);
        if self
            .tx
            .send(Command::Submit(Submitted { id, request }))
            .is_err()
        {
            s.queued.fetch_sub(1, Ordering::SeqCst);
            return Err(RequestError::Stopped);
        }
        Ok(id)
    }

    /// Ends request `id` and frees its pages (nothing if it has ended).
    pub fn cancel(&self, id: u64) {
        let _ = self.tx.send(Command::Cancel(id));
    }

    /// Refuses new requests from now on; the engine stops once the admitted and waiting ones
    /// are done.
    pub fn drain(&self) {
        self.shared.draining.store(true, Ordering::SeqCst);
        let _ = self.tx.send(Command::Drain);
    }

    pub fn is_draining(&self) -> bool {
        self.shared.draining.load(Ordering::SeqCst)
    }

    /// The engine's state after its last step.
    pub fn status(&self) -> EngineStatus {
        let mut st = self.shared.status.lock().expect("status lock").clone();
        st.waiting = st.waiting.max(self.shared.queued.load(Ordering::SeqCst));
        st
    }
}

impl EngineInbox {
    /// The next command: waits up to `wait` (none: returns at once).
    pub(crate) fn next(&self, wait: Option<Duration>) -> Option<Command> {
        match wait {
            None => self.rx.try_recv().ok(),
            Some(t) => self.rx.recv_timeout(t).ok(),
        }
    }

    /// A queued request left the queue (admitted, or dropped by its client).
    pub(crate) fn dequeued(&self) {
        self.shared.queued.fetch_sub(1, Ordering::SeqCst);
    }

    pub(crate) fn publish(&self, status: EngineStatus) {
        *self.shared.status.lock().expect("status lock") = status;
    }

    /// Refuses new requests (the engine is stopping).
    pub(crate) fn close(&self) {
        self.shared.draining.store(true, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits {
        max_context: 100,
        max_samples: 4,
        page_size: 16,
        pages: 12,
    };

    #[test]
    fn requests_that_cannot_run_are_refused_with_the_limit() {
        assert_eq!(LIMITS.check(10, 20, 1), Ok(()));
        let e = LIMITS.check(90, 20, 1).unwrap_err();
        assert!(
            e.to_string()
                .contains("maximum context length is 100 tokens"),
            "{e}"
        );
        assert!(e.to_string().contains("90 prompt tokens"), "{e}");
        assert_eq!(LIMITS.check(0, 1, 1), Err(RequestError::EmptyPrompt));
        assert_eq!(LIMITS.check(1, 0, 1), Ok(()));
        assert_eq!(LIMITS.check(1, 1, 5), Err(RequestError::Samples { max: 4 }));
        // 2 + 1 prompt pages, 4 samples of 3 + 1 pages each.
        assert!(matches!(
            LIMITS.check(20, 40, 4),
            Err(RequestError::TooBig { need: 19, .. })
        ));
    }
}
