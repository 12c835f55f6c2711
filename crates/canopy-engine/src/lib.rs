//! # canopy-engine
//!
//! Executes plans on a [`Backend`] and runs decode steps across ranks.
//!
//! - [`backend`]: the trait every executor implements; [`cpu::CpuBackend`] is the reference
//!   executor (and the oracle of every GPU test).
//! - [`merge`]: the cross-rank Tree Attention merges (`allreduce3`, `allreduce2`, `allgather`,
//!   `hierarchical`, `auto`); [`topology`] places ranks on nodes; [`cost`] models each merge's
//!   collective calls, for `auto` and for scaling predictions.
//! - [`strategy`]: the per-rank decode loop for the tree and ring strategies, generic over the
//!   transport ([`canopy_comm::Collective`]), and the thread-per-rank driver.
//! - [`tree_bench`]: every planning method on one tree, timed and checked on any backend.
//! - [`memory`]: what a run will allocate on the host, priced before it starts, and what this
//!   process may still allocate.

pub mod backend;
pub mod conformance;
pub mod cost;
pub mod cpu;
mod error;
pub mod memory;
pub mod merge;
pub mod predict;
pub mod strategy;
pub mod topology;
pub mod tree_bench;

pub use backend::{Backend, Cache};
pub use cost::CostModel;
pub use cpu::CpuBackend;
pub use error::{EngineError, Result};
pub use merge::{merge_across, MergeCollective};
pub use strategy::{
    rank_main, ring_buffers, run_threads, Problem, RankResult, RunConfig, RunReport, Strategy,
};
pub use topology::NodeLayout;
