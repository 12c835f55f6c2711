//! One generation request between its client and the engine: the request checked and
//! submitted, then the engine's events turned into one response or a stream of server-sent
//! events (`data: {chunk}` … `data: [DONE]`). A client that goes away drops the job, which
//! cancels the request in the engine and frees its pages; so does the server's [`Abort`],
//! which also tells the client.

#[cfg(doc)]
use crate::abort::Abort;

use crate::api::{
    ChatChoice, ChatMessage, Delta, DeltaChoice, PromptDetails, Response, Sampling, TextChoice,
    Usage,
};
use crate::error::ApiError;
use crate::logprobs::{self, ChatLogprobs, Entry, TextLogprobs};
use crate::metrics::Outcome;
use crate::routes::AppState;
use axum::http::StatusCode;
use axum::response::sse::{Event as Sse, KeepAlive};
use axum::response::{IntoResponse, Json};
use canopy_runtime::serving::{Event, EventSink, FinishReason, ServeRequest};
use canopy_runtime::SamplingParams;
use futures_util::stream::{self, Stream};
use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

/// Which endpoint a job answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Text,
    Chat,
}

/// `max_tokens` of a completion that gives none (OpenAI's default).
const COMPLETION_MAX_TOKENS: usize = 16;
/// `max_tokens` of a chat that gives none, at most (less where the context ends first).
const CHAT_MAX_TOKENS: usize = 1024;
/// How often a stream that has nothing to say sends a comment: a request waiting in the
/// queue learns this soon that its client has gone.
const KEEP_ALIVE: std::time::Duration = std::time::Duration::from_secs(2);
/// Stop strings of one request, at most.
const MAX_STOPS: usize = 16;

/// The engine's events for one of a job's prompts go to the job through its channel, their
/// samples numbered as the job's choices (the prompt's first at `first_choice`); the job's end
/// closes it, which the engine sees.
struct Sink {
    tx: UnboundedSender<Event>,
    first_choice: usize,
}

impl EventSink for Sink {
    fn send(&mut self, mut event: Event) -> bool {
        if let Event::Token { sample, .. }
        | Event::Finished { sample, .. }
        | Event::PromptLogprobs { sample, .. } = &mut event
        {
            *sample += self.first_choice;
        }
        self.tx.send(event).is_ok()
    }

    fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }
}

/// Biases of a request's `logit_bias` (token ids as text, each below `vocab`).
fn logit_bias(
    bias: Option<std::collections::HashMap<String, f32>>,
    vocab: usize,
) -> Result<Vec<(u32, f32)>, ApiError> {
    bias.unwrap_or_default()
        .into_iter()
        .map(|(token, b)| {
            let id = token
                .parse::<u32>()
                .ok()
                .filter(|&id| (id as usize) < vocab);
            match (id, b) {
                (Some(id), b) if (-100.0..=100.0).contains(&b) => Ok((id, b)),
                _ => Err(ApiError::invalid(
                    format!(
                        "logit_bias maps token ids below {vocab} to biases from -100 to 100; \
                         {token:?}: {b} is not one"
                    ),
                    Some("logit_bias"),
                )),
            }
        })
        .collect()
}

/// A submitted request: one engine request per prompt.
pub struct Job {
    st: Arc<AppState>,
    kind: Kind,
    ids: Vec<u64>,
    /// Choices: `n` per prompt, prompt by prompt.
    samples: usize,
    /// Each prompt's tokens.
    prompt_lens: Vec<usize>,
    stream: bool,
    include_usage: bool,
    /// Whether the choices report their tokens' log-probabilities.
    logprobs: bool,
    /// Whether each choice's text starts with its prompt's (a completion's `echo`).
    echo: bool,
    prompt_tokens: usize,
    events: UnboundedReceiver<Event>,
    /// True once the server stops without waiting for the job.
    aborted: tokio::sync::watch::Receiver<bool>,
    state: Progress,
}

/// What the engine has said of a job so far.
struct Progress {
    arrived: Instant,
    /// The job's engine requests admitted so far.
    started: usize,
    cached_tokens: usize,
    texts: Vec<String>,
    /// Characters in each of `texts`.
    chars: Vec<usize>,
    /// Each sample's tokens with their log-probabilities, if the request asked for them.
    entries: Vec<Vec<Entry>>,
    /// Entries of each sample already streamed.
    streamed: Vec<usize>,
    /// `n`: the choices of each prompt.
    per_prompt: usize,
    /// Each choice's next prompt entry to take its log-probabilities (the first has none).
    filled: Vec<usize>,
    /// Whether each prompt's echo was streamed.
    echoed: Vec<bool>,
    tokens: Vec<usize>,
    finished: Vec<Option<FinishReason>>,
    last_token: Vec<Option<Instant>>,
    first_token: bool,
    /// How it ended (`None`: still running, or its client left).
    outcome: Option<Outcome>,
}

impl Job {
    /// Checks `sampling` and submits each of `prompts` to the engine; the choices of prompt
    /// `i` follow `echo[i]`, if given.
    pub fn submit(
        st: &Arc<AppState>,
        kind: Kind,
        prompts: Vec<Vec<u32>>,
        sampling: Sampling,
        echo: Option<Vec<String>>,
    ) -> Result<Job, ApiError> {
        let limits = st.engine.limits();
        let given = sampling.max_completion_tokens.or(sampling.max_tokens);
        let max_tokens = match given {
            Some(n) => n as usize,
            None if kind == Kind::Text => COMPLETION_MAX_TOKENS,
            None => limits
                .max_context
                .saturating_sub(prompts.iter().map(Vec::len).max().unwrap_or(0))
                .clamp(1, CHAT_MAX_TOKENS),
        };
        let field = match kind {
            Kind::Text => "prompt",
            Kind::Chat => "messages",
        };
        let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
        if let Some(e) = ApiError::context_length(
            field,
            longest,
            max_tokens,
            given.is_some(),
            limits.max_context,
        ) {
            return Err(e);
        }
        let temperature = sampling.temperature.unwrap_or(1.0);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(ApiError::invalid(
                "temperature must be between 0 and 2",
                Some("temperature"),
            ));
        }
        let top_p = sampling.top_p.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(ApiError::invalid("top_p must be in (0, 1]", Some("top_p")));
        }
        let top_k = match sampling.top_k.unwrap_or(0) {
            k if k < -1 => {
                return Err(ApiError::invalid(
                    "top_k must be -1, 0 (every token) or more",
                    Some("top_k"),
                ))
            }
            k => k.max(0) as usize,
        };
        let penalty = |value: Option<f32>, name: &'static str| {
            let range = canopy_runtime::PENALTY_RANGE;
            match value.unwrap_or(0.0) {
                p if range.contains(&p) => Ok(p),
                _ => Err(ApiError::invalid(
                    format!("{name} must be from {} to {}", range.start(), range.end()),
                    Some(name),
                )),
            }
        };
        let frequency_penalty = penalty(sampling.frequency_penalty, "frequency_penalty")?;
        let presence_penalty = penalty(sampling.presence_penalty, "presence_penalty")?;
        let repetition_penalty = sampling.repetition_penalty.unwrap_or(1.0);
        if !(repetition_penalty.is_finite() && repetition_penalty > 0.0) {
            return Err(ApiError::invalid(
                "repetition_penalty must be more than 0 (1: none)",
                Some("repetition_penalty"),
            ));
        }
        let logit_bias = logit_bias(sampling.logit_bias, st.vocab)?;
        let stop = sampling.stop.map(|s| s.into_vec()).unwrap_or_default();
        if stop.len() > MAX_STOPS || stop.iter().any(String::is_empty) {
            return Err(ApiError::invalid(
                format!("stop takes at most {MAX_STOPS} strings, none empty"),
                Some("stop"),
            ));
        }
        let logprobs = match kind {
            Kind::Text => logprobs::completion_request(sampling.logprobs)?,
            Kind::Chat => logprobs::chat_request(sampling.logprobs, sampling.top_logprobs)?,
        };
        // An echoed prompt's tokens are reported too.
        let prompt_logprobs = logprobs.filter(|_| echo.is_some());
        let samples = sampling.n.unwrap_or(1) as usize;
        let seed = sampling.seed.unwrap_or_else(|| {
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64)
        });
        let (tx, events) = unbounded_channel();
        let prompt_tokens = prompts.iter().map(Vec::len).sum();
        let choices = prompts.len() * samples;
        // Each choice's entries start with its echoed prompt's tokens, whose log-probabilities
        // come as the prompt is computed.
        let echoed: Vec<Vec<Entry>> = match prompt_logprobs {
            Some(_) => (prompts.iter())
                .map(|p| logprobs::prompt_entries(&st.tokenizer, p))
                .collect(),
            None => vec![Vec::new(); prompts.len()],
        };
        let prompt_lens: Vec<usize> = prompts.iter().map(Vec::len).collect();
        let mut ids = Vec::with_capacity(prompts.len());
        for (i, prompt) in prompts.into_iter().enumerate() {
            let submitted = st.engine.submit(ServeRequest {
                prompt,
                max_tokens,
                samples,
                sampling: SamplingParams {
                    temperature,
                    top_k,
                    top_p,
                    frequency_penalty,
                    presence_penalty,
                    repetition_penalty,
                },
                seed,
                stop: stop.clone(),
                ignore_eos: sampling.ignore_eos.unwrap_or(false),
                logprobs,
                prompt_logprobs,
                logit_bias: logit_bias.clone(),
                sink: Box::new(Sink {
                    tx: tx.clone(),
                    first_choice: i * samples,
                }),
            });
            match submitted {
                Ok(id) => ids.push(id),
                Err(e) => {
                    ids.iter().for_each(|&id| st.engine.cancel(id));
                    return Err(e.into());
                }
            }
        }
        // The engine took `samples` per prompt: each choice's entries and echo.
        let entries: Vec<Vec<Entry>> = (echoed.iter())
            .flat_map(|e| std::iter::repeat_n(e.clone(), samples))
            .collect();
        let echoes: Vec<String> = match &echo {
            Some(texts) => texts
                .iter()
                .flat_map(|t| std::iter::repeat_n(t.clone(), samples))
                .collect(),
            None => vec![String::new(); choices],
        };
        Ok(Job {
            st: st.clone(),
            kind,
            ids,
            samples: choices,
            prompt_lens,
            stream: sampling.stream,
            include_usage: sampling.stream_options.is_some_and(|o| o.include_usage),
            logprobs: logprobs.is_some(),
            echo: echo.is_some(),
            prompt_tokens,
            events,
            aborted: st.abort.watch(),
            state: Progress {
                arrived: Instant::now(),
                started: 0,
                cached_tokens: 0,
                chars: echoes.iter().map(|t| t.chars().count()).collect(),
                texts: echoes,
                per_prompt: samples,
                entries,
                filled: vec![1; choices],
                echoed: vec![false; choices / samples.max(1)],
                streamed: vec![0; choices],
                tokens: vec![0; choices],
                finished: vec![None; choices],
                last_token: vec![None; choices],
                first_token: false,
                outcome: None,
            },
        })
    }

    pub async fn respond(self) -> axum::response::Response {
        if self.stream {
            axum::response::Sse::new(self.sse())
                .keep_alive(KeepAlive::new().interval(KEEP_ALIVE))
                .into_response()
        } else {
            self.whole().await
        }
    }

    /// The next event that says something; an engine that stopped or failed the request is
    /// an error, and so is the server's abort, which it heeds first.
    async fn next(&mut self) -> Result<Event, ApiError> {
        let received = tokio::select! {
            biased;
            Ok(_) = self.aborted.wait_for(|&aborted| aborted) => None,
            event = self.events.recv() => Some(event),
        };
        let event = match received {
            None => return Err(self.abort()),
            Some(None) => return Err(self.fail("the server stopped before the request finished")),
            Some(Some(Event::Failed(e))) => return Err(self.fail(&e)),
            Some(Some(event)) => event,
        };
        self.state.see(&self.st, &event);
        Ok(event)
    }

    /// Waits for every sample, then answers once.
    async fn whole(mut self) -> axum::response::Response {
        while !self.state.done() {
            if let Err(e) = self.next().await {
                return e.into_response();
            }
        }
        self.end(Outcome::Completed);
        let usage = Some(self.usage());
        match self.kind {
            Kind::Text => Json(self.response(
                "text_completion",
                self.texts_as(|index, text, reason| TextChoice {
                    index,
                    text,
                    logprobs: self.text_logprobs(index, 0),
                    finish_reason: reason,
                }),
                usage,
            ))
            .into_response(),
            Kind::Chat => Json(self.response(
                "chat.completion",
                self.texts_as(|index, text, reason| ChatChoice {
                    index,
                    message: ChatMessage {
                        role: "assistant",
                        content: text,
                    },
                    logprobs: self.chat_logprobs(index, 0),
                    finish_reason: reason,
                }),
                usage,
            ))
            .into_response(),
        }
    }

    /// Each event as a chunk, then the usage (if asked) and `[DONE]`. A request that fails
    /// midway ends with its error's event, then `[DONE]` too, as other OpenAI-compatible
    /// servers end theirs: clients that read to `[DONE]` stop there rather than wait on a
    /// stream that says no more.
    fn sse(self) -> impl Stream<Item = Result<Sse, Infallible>> {
        /// Where the stream is.
        enum At {
            Running(Box<Job>),
            Usage(Box<Job>),
            /// Only `[DONE]` is left to send.
            Done(Box<Job>),
            Over,
        }
        stream::unfold(At::Running(Box::new(self)), |at| async move {
            match at {
                At::Running(mut job) => loop {
                    let event = match job.next().await {
                        Ok(event) => event,
                        Err(e) => return Some((Ok(Sse::default().data(e.body())), At::Done(job))),
                    };
                    if let Some(chunk) = job.chunk(&event) {
                        let next = if job.state.done() {
                            job.end(Outcome::Completed);
                            At::Usage(job)
                        } else {
                            At::Running(job)
                        };
                        return Some((Ok(Sse::default().data(chunk)), next));
                    }
                },
                At::Usage(job) if job.include_usage => {
                    let usage = job.response::<TextChoice>(
                        job.chunk_object(),
                        Vec::new(),
                        Some(job.usage()),
                    );
                    Some((Ok(Sse::default().data(job.json(usage))), At::Done(job)))
                }
                At::Usage(job) | At::Done(job) => {
                    drop(job);
                    Some((Ok(Sse::default().data("[DONE]")), At::Over))
                }
                At::Over => None,
            }
        })
    }

    /// The chunk an event makes (`None`: nothing to send); a sample's chunk carries the
    /// log-probabilities of its tokens since its last chunk.
    fn chunk(&mut self, event: &Event) -> Option<String> {
        let first_started = self.state.started == 1;
        let (sample, text, reason) = match event {
            Event::Started { .. } | Event::PromptLogprobs { .. } if self.echo => {
                return self.echo_chunk()
            }
            Event::Started { .. } if self.kind == Kind::Chat && first_started => {
                let choices = (0..self.samples)
                    .map(|index| DeltaChoice {
                        index,
                        delta: Delta {
                            role: Some("assistant"),
                            content: Some(String::new()),
                        },
                        logprobs: None,
                        finish_reason: None,
                    })
                    .collect();
                return Some(self.json(self.response(self.chunk_object(), choices, None)));
            }
            Event::Token { sample, text, .. } if !text.is_empty() => (*sample, text.clone(), None),
            Event::Finished {
                sample,
                reason,
                text,
            } => (*sample, text.clone(), Some(reason.name())),
            _ => return None,
        };
        let since = self.state.streamed[sample];
        self.state.streamed[sample] = self.state.entries[sample].len();
        Some(match self.kind {
            Kind::Text => self.json(self.response(
                self.chunk_object(),
                vec![TextChoice {
                    index: sample,
                    text,
                    logprobs: self.text_logprobs(sample, since),
                    finish_reason: reason,
                }],
                None,
            )),
            Kind::Chat => self.json(self.response(
                self.chunk_object(),
                vec![DeltaChoice {
                    index: sample,
                    delta: Delta {
                        role: None,
                        content: (!text.is_empty()).then_some(text),
                    },
                    logprobs: self.chat_logprobs(sample, since),
                    finish_reason: reason,
                }],
                None,
            )),
        })
    }

    /// The echo of each prompt not yet streamed whose tokens' log-probabilities are all in (at
    /// once, where none are asked for), as one chunk: its choices' texts, which nothing drawn
    /// has joined yet.
    fn echo_chunk(&mut self) -> Option<String> {
        let n = self.state.per_prompt;
        let mut choices = Vec::new();
        for (p, &len) in self.prompt_lens.iter().enumerate() {
            let first = p * n;
            let complete = !self.logprobs || self.state.filled[first] >= len;
            if self.state.echoed[p] || !complete {
                continue;
            }
            self.state.echoed[p] = true;
            for c in first..first + n {
                choices.push(TextChoice {
                    index: c,
                    text: self.state.texts[c].clone(),
                    logprobs: self.text_logprobs(c, 0),
                    finish_reason: None,
                });
                self.state.streamed[c] = self.state.entries[c].len();
            }
        }
        (!choices.is_empty()).then(|| self.json(self.response(self.chunk_object(), choices, None)))
    }

    /// A completion choice's log-probabilities of sample `sample`'s tokens from `since` on.
    fn text_logprobs(&self, sample: usize, since: usize) -> Option<TextLogprobs> {
        self.logprobs
            .then(|| TextLogprobs::of(&self.st.tokenizer, &self.state.entries[sample][since..]))
    }

    /// A chat choice's log-probabilities of sample `sample`'s tokens from `since` on.
    fn chat_logprobs(&self, sample: usize, since: usize) -> Option<ChatLogprobs> {
        self.logprobs
            .then(|| ChatLogprobs::of(&self.st.tokenizer, &self.state.entries[sample][since..]))
    }

    fn json<C: serde::Serialize>(&self, r: Response<C>) -> String {
        serde_json::to_string(&r).expect("a chunk serializes")
    }

    fn chunk_object(&self) -> &'static str {
        match self.kind {
            Kind::Text => "text_completion",
            Kind::Chat => "chat.completion.chunk",
        }
    }

    fn response<C>(
        &self,
        object: &'static str,
        choices: Vec<C>,
        usage: Option<Usage>,
    ) -> Response<C> {
        Response {
            id: match self.kind {
                Kind::Text => format!("cmpl-{}", self.ids[0]),
                Kind::Chat => format!("chatcmpl-{}", self.ids[0]),
            },
            object,
            created: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            model: self.st.model.clone(),
            choices,
            usage,
        }
    }

    fn texts_as<C>(&self, f: impl Fn(usize, String, Option<&'static str>) -> C) -> Vec<C> {
        self.state
            .texts
            .iter()
            .zip(&self.state.finished)
            .enumerate()
            .map(|(i, (text, reason))| f(i, text.clone(), reason.map(FinishReason::name)))
            .collect()
    }

    fn usage(&self) -> Usage {
        let completion: usize = self.state.tokens.iter().sum();
        Usage {
            prompt_tokens: self.prompt_tokens,
            completion_tokens: completion,
            total_tokens: self.prompt_tokens + completion,
            prompt_tokens_details: PromptDetails {
                cached_tokens: self.state.cached_tokens,
            },
        }
    }
}

impl Progress {
    /// Takes in an event; times the tokens.
    fn see(&mut self, st: &AppState, event: &Event) {
        match event {
            Event::Started { cached_tokens } => {
                self.started += 1;
                self.cached_tokens += cached_tokens;
            }
            Event::Token {
                sample,
                token,
                text,
                logprobs,
            } => {
                let now = Instant::now();
                if !self.first_token {
                    self.first_token = true;
                    st.metrics
                        .first_token(now.duration_since(self.arrived).as_secs_f64());
                }
                if let Some(last) = self.last_token[*sample] {
                    st.metrics
                        .between_tokens(now.duration_since(last).as_secs_f64());
                }
                self.last_token[*sample] = Some(now);
                self.tokens[*sample] += 1;
                if let Some(logprobs) = logprobs {
                    self.entries[*sample].push(Entry {
                        token: *token,
                        logprobs: Some(logprobs.clone()),
                        text_offset: self.chars[*sample],
                    });
                }
                self.push_text(*sample, text);
            }
            Event::PromptLogprobs { sample, logprobs } => {
                for c in *sample..*sample + self.per_prompt {
                    for lp in logprobs {
                        if let Some(e) = self.entries[c].get_mut(self.filled[c]) {
                            e.logprobs = Some(lp.clone());
                            self.filled[c] += 1;
                        }
                    }
                }
            }
            Event::Finished {
                sample,
                reason,
                text,
            } => {
                self.push_text(*sample, text);
                self.finished[*sample] = Some(*reason);
            }
            Event::Failed(_) => {}
        }
    }

    fn push_text(&mut self, sample: usize, text: &str) {
        self.texts[sample].push_str(text);
        self.chars[sample] += text.chars().count();
    }

    fn done(&self) -> bool {
        self.finished.iter().all(Option::is_some)
    }
}

impl Job {
    /// Counts the job's end, once, however it ends.
    fn end(&mut self, outcome: Outcome) {
        if self.state.outcome.is_some() {
            return;
        }
        self.state.outcome = Some(outcome);
        let m = &self.st.metrics;
        m.outcome(outcome);
        m.finished(
            self.prompt_tokens,
            self.state.tokens.iter().sum(),
            self.state.arrived.elapsed().as_secs_f64(),
        );
    }

    fn fail(&mut self, message: &str) -> ApiError {
        self.end(Outcome::Failed);
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, message, "engine_error")
    }

    /// Ends the job's requests in the engine and frees their pages, once.
    fn cancel(&mut self) {
        if self.state.outcome.is_none() {
            self.end(Outcome::Cancelled);
            self.events.close();
            self.ids.iter().for_each(|&id| self.st.engine.cancel(id));
        }
    }

    /// The server stops without waiting: the job is cancelled, and its client told why.
    fn abort(&mut self) -> ApiError {
        self.cancel();
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "the server stopped before the request finished; retry with another replica",
            "shutting_down",
        )
    }
}

/// A job dropped unfinished lost its client: the request is cancelled and its pages freed.
impl Drop for Job {
    fn drop(&mut self) {
        self.cancel();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::abort::Abort;
    use canopy_runtime::serving::EngineInbox;

    /// A server's state over an engine that takes requests and never runs them, so that a
    /// test tells a job's events itself.
    fn state() -> (Arc<AppState>, EngineInbox) {
        state_with(Abort::new())
    }

    fn state_with(abort: Abort) -> (Arc<AppState>, EngineInbox) {
        crate::router_tests::idle_state("m", None, abort)
    }

    /// The `data:` lines of a streamed response, in order.
    async fn events(response: axum::response::Response) -> Vec<String> {
        let body = axum::body::to_bytes(response.into_body(), 1 << 20)
            .await
            .unwrap();
        (String::from_utf8(body.to_vec()).unwrap().lines())
            .filter_map(|l| l.strip_prefix("data: ").map(str::to_string))
            .collect()
    }

    /// A chat that fills the context without max_tokens is refused naming its messages, not
    /// a max_tokens it did not send.
    #[test]
    fn a_chat_too_long_alone_names_its_messages() {
        let (st, _inbox) = state();
        let sampling: Sampling = serde_json::from_str("{}").unwrap();
        let Err(e) = Job::submit(&st, Kind::Chat, vec![vec![65; 64]], sampling, None) else {
            panic!("a chat of 64 tokens fits no answer in 64");
        };
        assert_eq!(e.param.as_deref(), Some("messages"));
        assert!(!e.message.contains("max_tokens"), "{e}");
    }

    /// A stream whose request fails after its first token sends that token's chunk, the
    /// error's event and `[DONE]`, and counts the request failed.
    #[tokio::test]
    async fn a_stream_that_fails_midway_ends_with_its_error_then_done() {
        let (st, _inbox) = state();
        let sampling: Sampling = serde_json::from_str(r#"{"stream": true}"#).unwrap();
        let mut job = Job::submit(&st, Kind::Text, vec![vec![65, 66]], sampling, None).unwrap();
        let (tx, rx) = unbounded_channel();
        job.events = rx;
        tx.send(Event::Started { cached_tokens: 0 }).unwrap();
        tx.send(Event::Token {
            sample: 0,
            token: 67,
            text: "C".into(),
            logprobs: None,
        })
        .unwrap();
        tx.send(Event::Failed("a rank failed".into())).unwrap();
        let events = events(job.respond().await).await;
        assert_eq!(events.len(), 3, "{events:?}");
        let chunk: serde_json::Value = serde_json::from_str(&events[0]).unwrap();
        assert_eq!(chunk["choices"][0]["text"], "C");
        let error: serde_json::Value = serde_json::from_str(&events[1]).unwrap();
        assert_eq!(error["error"]["message"], "a rank failed");
        assert_eq!(error["error"]["code"], "engine_error");
        assert_eq!(events[2], "[DONE]");
        assert!(st
            .metrics
            .render(&st.engine.status())
            .contains("outcome=\"failed\"} 1"));
    }

    /// The server's abort ends a stream that is waiting for its next token with an error
    /// event and `[DONE]`, and a whole request with a 503; each counts as cancelled.
    #[tokio::test]
    async fn an_abort_ends_streams_and_whole_requests_with_an_error() {
        let abort = Abort::new();
        let (st, _inbox) = state_with(abort.clone());
        let submit = |stream: bool| {
            let sampling: Sampling =
                serde_json::from_str(&format!(r#"{{"stream": {stream}}}"#)).unwrap();
            Job::submit(&st, Kind::Chat, vec![vec![65]], sampling, None).unwrap()
        };
        let (streamed, whole) = (submit(true), submit(false));
        let streamed = tokio::spawn(async move { events(streamed.respond().await).await });
        let whole = tokio::spawn(whole.respond());
        tokio::task::yield_now().await;
        abort.abort();
        let events = streamed.await.unwrap();
        assert_eq!(events.len(), 2, "{events:?}");
        let error: serde_json::Value = serde_json::from_str(&events[0]).unwrap();
        assert_eq!(error["error"]["code"], "shutting_down");
        assert_eq!(events[1], "[DONE]");
        let whole = whole.await.unwrap();
        assert_eq!(whole.status(), StatusCode::SERVICE_UNAVAILABLE);
        // A job that starts after the abort ends at once.
        let late = submit(false).respond().await;
        assert_eq!(late.status(), StatusCode::SERVICE_UNAVAILABLE);
        let metrics = st.metrics.render(&st.engine.status());
        assert!(metrics.contains("outcome=\"cancelled\"} 3"), "{metrics}");
    }
}
