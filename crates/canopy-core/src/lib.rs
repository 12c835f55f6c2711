//! # canopy-core
//!
//! The GPU-free heart of canopy: exact attention math, KV trees, the plan type, every planner,
//! rank sharding and the benchmark workloads.
//!
//! Everything downstream consumes these types unchanged: the CPU backend (the oracle for all
//! GPU tests) and the CUDA backend execute the same [`Plan`]s; the distributed engine shards a
//! [`KvTree`] with [`shard_tree`] and merges per-rank partial states with [`merge_state`]'s
//! conventions (fp32 `o` normalised, natural-log `lse`, empty partial `o = 0, lse = -inf`).

pub mod coded;
pub mod data;
pub mod device_model;
pub mod dtype;
pub mod error;
pub mod geometry;
pub mod logits;
pub mod math;
pub mod plan;
pub mod planner;
pub mod random_trees;
pub mod shape;
pub mod shard;
pub mod stats;
pub mod tree;
pub mod workload;

pub use coded::{coded_value, cut_at_multiples, CodedMatrix, CodedSliceMut, WeightPart};
pub use data::{HashedKv, KvSource, PagedKv, ProblemData, SliceKv};
pub use device_model::{DeviceModel, PlanCost, Sample};
pub use dtype::{DType, KvElement, TypedSliceMut, TypedVec};
pub use error::{CoreError, Result};
pub use math::{merge_state, reference_attention, relative_error, AttnStates, EMPTY_LSE};
pub use plan::{Group, IoReport, Plan, Tail};
pub use planner::{
    auto_candidates, auto_choices, choose, plan, predictions, AutoChoice, FastTreeParams, Method,
    PlannerConfig,
};
pub use shape::AttnShape;
pub use shard::{shard_tree, Shard, TreeView};
pub use tree::{KvTree, NamedNode, NodeId, TreeBuilder};
pub use workload::{builtin_names, random_tree, Overrides, TreeSpec, WorkloadSpec};
