//! The backend trait every executor implements (CPU here; CUDA in `canopy-cuda`).
//!
//! The split mirrors a GPU's: data lives in backend-owned buffers (`Kv`, `Queries`, `States`),
//! plans are uploaded once and executed many times, and only [`Backend::download`] brings
//! results back to the host. Stage 1 ([`Backend::run_plan`]) writes one partial row per
//! (group, query); stage 2 ([`Backend::merge`]) folds each query's rows in the plan's CSR order.

use crate::Result;
use canopy_core::{AttnShape, AttnStates, DType, Plan, TypedVec};

pub trait Backend: Send + Sync {
    type Kv: Send;
    type Queries: Send;
    type Plan: Send + Sync;
    type States: Send;

    fn name(&self) -> &'static str;
    /// Storage for `tokens` tokens of K and V (`tokens × kv_heads × head_dim` each).
    fn alloc_kv(&self, shape: &AttnShape, dtype: DType, tokens: usize) -> Result<Self::Kv>;
    /// Writes `k` and `v` (whole tokens, same dtype) starting at token `start`.
    fn write_kv(&self, kv: &mut Self::Kv, start: usize, k: &TypedVec, v: &TypedVec) -> Result<()>;
    /// Query rows, `rows × q_heads × head_dim` fp32 (the kernels read them in the KV dtype).
    fn upload_queries(&self, shape: &AttnShape, q: &[f32]) -> Result<Self::Queries>;
    fn upload_plan(&self, plan: &Plan) -> Result<Self::Plan>;
    /// Stage 1: one partial row per (group, query) of the plan.
    fn run_plan(&self, kv: &Self::Kv, q: &Self::Queries, plan: &Self::Plan)
        -> Result<Self::States>;
    /// Stage 2: one state per query (empty where the query has no keys here).
    fn merge(&self, partials: &Self::States, plan: &Self::Plan) -> Result<Self::States>;
    fn download(&self, states: &Self::States) -> Result<AttnStates>;
}

/// KV storage whose bytes the host can address directly, so KV blocks can travel between
/// ranks through a host [`canopy_comm::Collective`] (the ring strategy on host transports).
pub trait HostKv {
    fn tokens(&self) -> usize;
    /// K and V bytes of the first `tokens` tokens.
    fn bytes(&self, tokens: usize) -> (&[u8], &[u8]);
    fn bytes_mut(&mut self, tokens: usize) -> (&mut [u8], &mut [u8]);
}
