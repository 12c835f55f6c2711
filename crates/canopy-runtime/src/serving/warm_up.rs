//! A server's warm-up, before clients are told it is ready, so that what a backend sets up on
//! first use (on a GPU: cuBLAS, about 0.2 s, and each kernel its GEMMs pick, loaded the first
//! time it runs) is not paid inside clients' steps:
//! - every rank runs its model's products at the row counts its steps will run, up to
//!   [`super::ServeConfig::most_step_rows`] ([`crate::ModelLayers::warm_up_products`]);
//! - then one request goes through the engine ([`WarmUp`]). Its prompt fills one step's
//!   prefill chunk and it decodes two tokens. It is an ordinary request: it counts in the
//!   engine's status, and its prompt stays in the prefix cache as evictable pages.

use super::handle::{EngineHandle, Event, EventSink, RequestError, ServeRequest};
use crate::sampling::SamplingParams;
use std::sync::mpsc::{channel, Receiver, Sender};

/// Tokens the warm-up decodes after its prompt: a decode step, then one replayed where the
/// backend records steps.
const WARM_UP_TOKENS: usize = 2;

/// A submitted warm-up request, to wait for.
pub struct WarmUp(Receiver<Result<(), String>>);

/// How the warm-up ended, for [`WarmUp::wait`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WarmUpEnd {
    /// It ran to its last token.
    Done,
    /// The engine refused or failed it, and runs on.
    Failed(String),
    /// The engine stopped first.
    Stopped,
}

impl WarmUp {
    /// Submits the warm-up: a prompt of `tokens` tokens (at most what a request may hold),
    /// token ids spread over a vocabulary of `vocab`.
    pub fn submit(
        handle: &EngineHandle,
        tokens: usize,
        vocab: usize,
    ) -> Result<Self, RequestError> {
        let limits = handle.limits();
        let len = tokens
            .min(limits.max_context.saturating_sub(WARM_UP_TOKENS))
            .max(1);
        let (tx, rx) = channel();
        handle.submit(ServeRequest {
            prompt: (0..len).map(|i| (i * 7919 % vocab.max(1)) as u32).collect(),
            max_tokens: WARM_UP_TOKENS,
            samples: 1,
            sampling: SamplingParams::default(),
            seed: 0,
            stop: Vec::new(),
            ignore_eos: true,
            logprobs: None,
            prompt_logprobs: None,
            logit_bias: Vec::new(),
            sink: Box::new(Ends(tx)),
        })?;
        Ok(WarmUp(rx))
    }

    /// Blocks until the warm-up ends.
    pub fn wait(self) -> WarmUpEnd {
        match self.0.recv() {
            Ok(Ok(())) => WarmUpEnd::Done,
            Ok(Err(reason)) => WarmUpEnd::Failed(reason),
            Err(_) => WarmUpEnd::Stopped,
        }
    }
}

/// The warm-up's sink: passes on how it ended, nothing else.
struct Ends(Sender<Result<(), String>>);

impl EventSink for Ends {
    fn send(&mut self, event: Event) -> bool {
        match event {
            Event::Finished { .. } => self.0.send(Ok(())).is_ok(),
            Event::Failed(reason) => self.0.send(Err(reason)).is_ok(),
            _ => true,
        }
    }

    fn is_closed(&self) -> bool {
        false
    }
}
