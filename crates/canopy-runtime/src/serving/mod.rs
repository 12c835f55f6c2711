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
    /// Whether the tree strategy's decode steps run their rows padded to a few batch sizes
    /// ([`batch_rows`], [`held_batch`]): rows past a step's own decode token 0 at position 0, store their keys
    /// in a page of each pool that no request holds, and have no keys to attend. A step then
    /// keeps its rows, plan buffers and recorded pass while requests join and leave within a
    /// batch size. For a backend that replays recorded passes.
    pub pad_rows: bool,
}

/// The rows a decode step of `rows` rows runs when they are padded: the next power of two up
/// to 8, then the next multiple of an eighth of the next power of two (at least 8), so that
/// padding adds at most 1/8 past 64 rows. Never past `max_batch`, unless `rows` is.
pub fn batch_rows(rows: usize, max_batch: usize) -> usize {
    let size = match rows {
        0..=8 => rows.next_power_of_two(),
        _ => rows.next_multiple_of((rows.next_power_of_two() / 8).max(8)),
    };
    size.min(max_batch.max(rows))
}

/// The batch size a padded decode step of `rows` rows runs after one of `held` rows: `held`
/// while the rows fit it and it is at most one batch size past theirs, else theirs
/// ([`batch_rows`]). Rows that hover about a batch size's edge then keep one size, and the
/// step its recording, rather than alternate between two.
pub fn held_batch(rows: usize, held: usize, max_batch: usize) -> usize {
    let size = batch_rows(rows, max_batch);
    let next = batch_rows(size + 1, max_batch);
    if rows <= held && held <= next {
        held
    } else {
        size
    }
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
            self.pool_tokens() * ranks_here,
            self.most_step_rows(),
            // The logits of each shape a decode pass keeps, each at most a batch.
            crate::forward::KEPT_PASSES * self.max_batch,
        ))
    }

    /// KV slots of each rank's pool: its pages, and with [`ServeConfig::pad_rows`] one page
    /// past them where padding rows store their keys.
    pub fn pool_tokens(&self) -> usize {
        (self.pages_per_rank + self.pad_rows as u32) as usize * self.page_size as usize
    }

    /// Where padding rows store their keys: the first slot past the pool's pages (`None`
    /// without [`ServeConfig::pad_rows`]).
    pub(crate) fn pad_slot(&self) -> Option<u32> {
        self.pad_rows
            .then_some(self.pages_per_rank * self.page_size)
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

#[cfg(test)]
mod tests {
    use super::{batch_rows, held_batch};

    /// Batch sizes: powers of two to 8, then steps of 8 to 64, 16 to 128, 32 to 256; never
    /// fewer rows than the step's, never more than the batch allows past them.
    #[test]
    fn rows_pad_to_a_few_batch_sizes() {
        let sizes: Vec<usize> = (1..=130).map(|r| batch_rows(r, 256)).collect();
        assert_eq!(&sizes[..9], [1, 2, 4, 4, 8, 8, 8, 8, 16]);
        assert_eq!(batch_rows(17, 256), 24);
        assert_eq!(batch_rows(57, 256), 64);
        assert_eq!(batch_rows(65, 256), 80);
        assert_eq!(batch_rows(129, 256), 160);
        for (r, &size) in (1..).zip(&sizes) {
            assert!(size >= r && size - r < 8.max(r / 4), "{r} -> {size}");
        }
        let mut distinct = sizes.clone();
        distinct.dedup();
        assert_eq!(distinct.len(), 4 + 7 + 4 + 1, "{distinct:?}");
        assert_eq!(batch_rows(5, 6), 6, "capped at the batch");
        assert_eq!(batch_rows(7, 6), 7, "a step past the batch is not padded");
    }

    /// A batch size holds while the rows fit it and it is at most one size past theirs.
    #[test]
    fn a_batch_size_holds_about_its_edge() {
        let mut held = 0;
        let sizes: Vec<usize> = [39, 41, 39, 47, 41, 33, 31, 33, 31, 30, 25, 24, 49, 41]
            .into_iter()
            .map(|rows| {
                held = held_batch(rows, held, 64);
                held
            })
            .collect();
        assert_eq!(
            sizes,
            [40, 48, 48, 48, 48, 48, 32, 40, 40, 40, 40, 24, 56, 56]
        );
        assert_eq!(
            held_batch(70, 64, 64),
            70,
            "rows past the batch run as they are"
        );
        assert_eq!(held_batch(3, 64, 64), 4);
    }
}
