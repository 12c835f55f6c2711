//! # canopy-engine
//!
//! Executes plans on a [`Backend`] and runs decode steps across ranks.
//!
//! - [`backend`]: the trait every executor implements; [`cpu::CpuBackend`] is the reference
//!   executor (and the oracle of every GPU test).
//! - [`merge`]: the cross-rank Tree Attention merges (`allreduce3`, `allreduce2`, `allgather`,
//!   `hierarchical`, `auto`); [`topology`] places ranks on nodes; [`cost`] models each merge's
//!   collective calls, for `auto` and for scaling predictions.
//! - [`step`]: one rank's attention for one decode step, tree or ring, over any backend and
//!   transport ([`merge::Transport`]): what a benchmark's ranks and a model's layers run.
//! - [`strategy`]: the attention benchmark's one rank loop on top of it (every backend and
//!   transport: threads, MPI, NCCL), its calibration of `auto`, and the thread-per-rank
//!   driver.
//! - [`tree_bench`]: every planning method on one tree, timed and checked on any backend;
//!   [`timed_auto`]: `auto` settled by timing the plans its device model cannot tell apart.
//! - [`layer_ops`]: the dense half of a transformer layer on a backend's own tensors, which a
//!   model drives around [`step`]'s attention.
//! - [`report`]: the one description of a distributed run, whatever backend and transport ran
//!   it.
//! - [`memory`]: what a run will allocate on the host, priced before it starts, and what this
//!   process may still allocate.

pub mod backend;
pub mod conformance;
pub mod cost;
pub mod cpu;
mod cpu_decode;
pub mod cpu_layers;
mod cpu_merge;
mod cpu_weight;
mod error;
pub mod host_ops;
pub mod layer_ops;
mod logit_checks;
pub mod memory;
pub mod merge;
pub mod predict;
pub mod report;
pub mod step;
pub mod strategy;
pub mod timed_auto;
pub mod topology;
pub mod tree_bench;

pub use backend::{Backend, Cache};
pub use cost::CostModel;
pub use cpu::CpuBackend;
pub use cpu_layers::HostMatrix;
pub use cpu_weight::CpuWeight;
pub use error::{EngineError, Result};
pub use layer_ops::{
    measure_gemm_rate, CachedKeys, FillRun, GemmShape, KeyBlock, KvStore, LayerOps, ModelNeeds,
    TOP_LOGITS_MAX,
};
pub use merge::{HostCollective, MergeCollective, MergeOps, StatesMerge, Transport};
pub use report::{Measured, RunReport};
pub use step::{ring_buffers, RankAttention, RingShard};
pub use strategy::{rank_main, run_threads, Problem, RankResult, RunConfig, Strategy};
pub use topology::NodeLayout;
