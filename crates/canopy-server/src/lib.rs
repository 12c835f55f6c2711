//! # canopy-server
//!
//! An OpenAI-compatible HTTP server (tokio + axum) over canopy's continuous-batching engine
//! ([`canopy_runtime::serving`]).
//!
//! - `POST /v1/completions` and `POST /v1/chat/completions`, whole or streamed as
//!   server-sent events ending with `data: [DONE]`, with `usage` (and the prompt tokens
//!   found in the prefix cache); `GET /v1/models` and `GET /v1/models/{id}` (with canopy's
//!   `max_model_len` and `vocab_size`); `POST /tokenize` and `POST /detokenize`, as other
//!   engines have them; `GET /health`; `GET /metrics` in Prometheus' text format.
//! - A completion may list several prompts: each is an engine request of its own, and their
//!   choices come in one response, prompt by prompt. Tokens' log-probabilities
//!   (`logprobs.rs`) and a completion's `echo` come in OpenAI's forms. Besides OpenAI's
//!   fields a request may set `ignore_eos` (as other engines do): its samples run to
//!   `max_tokens` past the model's end-of-sequence tokens, which a benchmark needs.
//! - Requests are parsed here (unknown fields ignored, `null` an optional field's default, a
//!   wrong type a 400 in OpenAI's error body that names the field), tokenized (a chat through the model's template), checked against the engine's
//!   limits (a prompt and `max_tokens` beyond the context a 400 that states it) and handed to
//!   the engine, which runs on threads of its own; its events come back through a channel
//!   per request. A full queue is a 429 with `Retry-After`; a request after a drain began, a
//!   503. A client that disconnects drops its request's channel, which cancels the request.
//! - A server that must stop without waiting for its requests ([`Abort`]) ends each with an
//!   error (a stream with its error event, then `[DONE]`) and cancels it in the engine.
//! - With an API key, every route but `/health` needs `Authorization: Bearer KEY`.
//!
//! [`client`] is a small blocking client of this server, for tests, and the server-sent events
//! reader that `canopy bench serve` shares with it.

mod abort;
mod api;
pub mod client;
mod error;
mod job;
mod logprobs;
mod metrics;
#[cfg(test)]
mod router_tests;
mod routes;

pub use abort::Abort;
pub use error::ApiError;
pub use metrics::{FloorFacts, Metrics};
pub use routes::{router, AppState};

use std::future::Future;
use std::sync::Arc;

/// Serves `state` on `listener` until `shutdown` resolves, then waits for the requests in
/// flight (their streams end when the engine has finished them).
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(state))
        .with_graceful_shutdown(shutdown)
        .await
}
