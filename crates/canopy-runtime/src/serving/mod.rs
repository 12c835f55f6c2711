//! Serving: many requests decoded together by one continuous-batching engine, their shared
//! prefixes cached and read once.
//!
//! - [`handle`]: the engine's front door, for a server's threads: submit a request (checked
//!   against the [`Limits`] and a bounded queue), cancel it, drain, read the engine's status.
//!   Each request's tokens come back as [`Event`]s through its [`EventSink`].
//! - `books` (every rank): the KV bookkeeping of the running requests on a
//!   [`canopy_kv::PrefixCache`]: each request's lease on its cached prefix, its prompt's node,
//!   its samples' branches. Every rank applies the same step descriptions to its copy, so all
//!   agree where every token lives.
//! - `scheduler` (rank 0): owns the batch. Between steps it admits waiting requests while rows
//!   and KV pages allow (one whose prefix is being prefilled for another waits until it is
//!   cached), ends finished and cancelled ones, and describes the next step: the
//!   decode rows of every running sample and chunks of the prompts still to prefill (a token
//!   budget per step, so a long prompt does not stall the streams). It says which rows are
//!   read beyond their likeliest tokens: the logits of the tokens a draw changes (penalties,
//!   biases), picked; their softmax totals for a draw over the whole vocabulary; reduced to
//!   their log-normalisers for a request that reports log-probabilities; whole for a draw that
//!   reaches past the narrowing or changes too many tokens. A draw the narrowed row does not
//!   settle reads its row whole after the step. After the step it draws each row's token (per-request
//!   sampling, seeded per sample; rows read whole in parallel), decodes the text, and finds
//!   stop tokens, stop strings and token limits.
//! - `engine` (every rank): the step loop. Rank 0 sends each step's description to the other
//!   ranks over the world's point-to-point calls; each rank applies it, runs the decode rows
//!   through [`crate::Forward::decode`] with attention planned over the live requests' whole KV
//!   tree (shared prefix pages read once per step), and each prompt chunk through the chunked
//!   prefill (causal within the chunk, the cached context through the paged pools; an
//!   echoed prompt's rows reduced on rank 0 for their tokens' log-probabilities). Each
//!   decode pass is timed on rank 0 beside the distinct KV bytes it must read
//!   ([`DecodePasses`], by batch size), the measure a step's floor is priced from.
//! - [`WarmUp`] and [`ServeConfig::most_step_rows`]: what a server runs before it says it is
//!   ready, so that a backend's set-up on first use is not a client's wait.

mod books;
mod engine;
pub mod handle;
mod scheduler;
mod step;
mod stop;
mod warm_up;

pub use engine::{serve, Front};
pub use handle::{
    channel, DecodePasses, EngineHandle, EngineInbox, EngineStatus, Event, EventSink, FinishReason,
    Limits, RequestError, ServeRequest,
};
pub use stop::held_back;
pub use warm_up::{warm_up_products, WarmUp, WarmUpEnd};

use crate::{DecodeStrategy, Result};
use canopy_core::{DType, Method};
use canopy_engine::ModelNeeds;

/// How an engine runs: its batch, its KV pools and how each step is planned.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    pub strategy: DecodeStrategy,
    /// How each rank plans its part of the live KV tree.
    pub method: Method,
    /// KV page size (tokens): the unit of prefix sharing.
    pub page_size: u32,
    pub kv_dtype: DType,
    /// Pages in each rank's pool.
    pub pages_per_rank: u32,
    /// The most sample rows decoded in one step.
    pub max_batch: usize,
    /// The longest context (prompt and new tokens) of one request.
    pub max_context: usize,
    /// Prompt tokens prefilled per step, over all prompts.
    pub prefill_chunk: usize,
    /// Whether decode steps may replay a recorded pass (as
    /// [`GenerateRequest::graphs`](crate::GenerateRequest::graphs)).
    pub graphs: bool,
}

impl ServeConfig {
    /// What the engine asks of a backend running `ranks_here` of its ranks with a model of
    /// `config` in `weight_dtype` (see
    /// [`LayerOps::check_model`](canopy_engine::LayerOps::check_model)).
    pub fn needs(
        &self,
        config: &canopy_model::LlamaConfig,
        weight_dtype: DType,
        ranks_here: usize,
    ) -> Result<ModelNeeds> {
        Ok(crate::layers::model_needs(
            config,
            weight_dtype,
            self.kv_dtype,
            (self.pages_per_rank * self.page_size) as usize * ranks_here,
            self.most_step_rows(),
            self.max_batch,
        ))
    }

    /// The most rows a step runs through the layers: its decode rows and its prompt chunks.
    pub fn most_step_rows(&self) -> usize {
        self.max_batch + self.prefill_chunk
    }

    /// The limits every request is checked against, over `ranks` ranks.
    pub fn limits(&self, ranks: usize) -> Limits {
        Limits {
            max_context: self.max_context,
            max_samples: self.max_batch,
            page_size: self.page_size as usize,
            pages: self.pages_per_rank as usize * ranks,
        }
    }
}
