//! A server's warm-up, before clients are told it is ready, so that what a backend sets up on
//! first use (on a GPU: cuBLAS, about 0.2 s, and each kernel its GEMMs pick, loaded the first
//! time it runs) is not paid inside clients' steps:
//! - every rank runs its model's products at the row counts its steps will run, up to
//!   [`super::ServeConfig::most_step_rows`] ([`warm_up_products`]). Rank 0 times the ways its
//!   backend can run each product as it goes ([`LayerOps::tune_products`]) and sends its
//!   choices to the other ranks, which adopt them before they warm up: every rank then runs
//!   each product the same way and computes the same bits;
//! - then one request goes through the engine ([`WarmUp`]). Its prompt fills one step's
//!   prefill chunk and it decodes two tokens. It is an ordinary request: it counts in the
//!   engine's status, and its prompt stays in the prefix cache as evictable pages.

use super::handle::{EngineHandle, Event, EventSink, RequestError, ServeRequest};
use crate::layers::ModelLayers;
use crate::sampling::SamplingParams;
use crate::Result;
use canopy_comm::Collective;
use canopy_engine::LayerOps;
use std::sync::mpsc::{channel, Receiver, Sender};

/// Tokens the warm-up decodes after its prompt: a decode step, then one replayed where the
/// backend records steps.
const WARM_UP_TOKENS: usize = 2;

/// Every rank's products at a server's row counts, up to `max_rows` (and the logits of up to
/// `logit_rows`), each run the way rank 0 timed fastest: rank 0 times them as it warms them
/// up, then sends its choices to the other ranks, which adopt them and warm up.
pub fn warm_up_products<B: LayerOps, C: Collective>(
    b: &B,
    layers: &ModelLayers<B>,
    comm: &C,
    max_rows: usize,
    logit_rows: usize,
) -> Result<()> {
    if comm.rank() != 0 {
        let mut len = [0u8; 8];
        comm.recv(&mut len, 0)?;
        let mut choices = vec![0u8; u64::from_le_bytes(len) as usize];
        if !choices.is_empty() {
            comm.recv(&mut choices, 0)?;
        }
        b.adopt_product_choices(&choices)?;
        return layers.warm_up_products(b, max_rows, logit_rows);
    }
    let timing = b.tune_products(true);
    let warmed = layers.warm_up_products(b, max_rows, logit_rows);
    let shared = timing
        .and_then(|()| b.tune_products(false))
        .and_then(|()| b.product_choices());
    // The other ranks wait for the choices, and get none where rank 0 failed to make them.
    let choices = shared.as_deref().unwrap_or_default();
    for peer in 1..comm.size() {
        comm.send(&(choices.len() as u64).to_le_bytes(), peer)?;
        if !choices.is_empty() {
            comm.send(choices, peer)?;
        }
    }
    warmed?;
    shared?;
    Ok(())
}

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
