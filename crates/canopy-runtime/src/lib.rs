//! # canopy-runtime
//!
//! Llama-family generation on canopy's engine: a prompt prefilled sequence-parallel over the
//! ranks, then decoded token by token with the KV cache sharded along the sequence and each
//! layer's attention merged across ranks by the tree collectives (or the ring baseline).
//!
//! - [`layers`]: a decoder's layers around attention (embedding, RMSNorm, the projections,
//!   RoPE, SwiGLU, the LM head), from a [`canopy_model::Model`]'s weights or
//!   [`RandomWeights`], read a matrix at a time and uploaded once to any backend that
//!   implements [`canopy_engine::LayerOps`] (the CPU's f32 arithmetic, or a GPU's) and shared
//!   by every rank on that device.
//! - [`kv`]: where each token's KV lives, on the KV-cache manager ([`canopy_kv`]): the prompt
//!   in pieces, each split over the ranks so that their causal attention work is even;
//!   samples as branches that share the prompt's pages.
//! - [`forward`]: one decode step's pass through every layer, shared by every decode loop.
//! - [`rank`]: one rank's generation: prefill, then decode steps whose attention is the
//!   engine's [`canopy_engine::RankAttention`], over a plan of the rank's part of the tree —
//!   so `n` parallel samples read their shared prompt once per step.
//! - [`sampling`]: greedy, temperature, top-k and top-p, seeded per sample.
//! - [`serving`]: a continuous-batching engine for a server: requests join and leave between
//!   steps, prompts are prefilled in chunks between decode steps, and prefixes are shared
//!   through a radix cache over the KV pages, read once per step by the tree planners.

mod error;
pub mod forward;
pub mod kv;
pub mod layers;
mod prefill;
mod random_weights;
pub mod rank;
pub mod sampling;
pub mod serving;

pub use error::{Result, RuntimeError};
pub use forward::{Forward, StepRows};
pub use layers::ModelLayers;
pub use random_weights::RandomWeights;
pub use rank::{
    generate, ContextFill, DecodeStrategy, GenerateRequest, Generated, Watch, DEFAULT_PREFILL_CHUNK,
};
pub use sampling::{
    step_reach, RowLogits, RowTerms, Sampler, SamplingParams, StepLogits, TokenLogprobs, TopTwo,
    LOGPROBS_MAX, PENALTY_RANGE,
};
