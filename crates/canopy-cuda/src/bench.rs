//! `canopy bench kernel`: the decode kernels on one GPU against the memory floor.
//!
//! KV is generated on the device (hash-based, never zeros) so gigabytes of cache cost no host
//! traffic; the f64 oracle regenerates the same values on the CPU. Each point reports the
//! median of CUDA-event timings of one decode step (stage 1 + stage 2) and of stage 1 alone,
//! the bytes the step must move (KV + queries + partials written and read + outputs), the
//! bandwidth that implies, and the floor `bytes / measured copy bandwidth`.

use crate::backend::CudaBackend;
use crate::error::Result;
use canopy_core::data::{hashed_oracle, hashed_queries};
use canopy_core::stats::{median, quantile};
use canopy_core::{
    plan, relative_error, AttnShape, DType, Method, Overrides, PlannerConfig, Shard, TreeView,
    WorkloadSpec,
};
use canopy_engine::{Backend, Cache};
use serde::Serialize;

#[derive(Debug, Clone, Serialize)]
pub struct KernelPoint {
    pub seq_len: u32,
    pub batch: u32,
    /// Groups after splitting for parallelism (CTAs = groups × KV heads).
    pub groups: usize,
    pub median_ms: f64,
    /// Median of stage 1 alone, timed separately: the step's time beyond it is the merge's
    /// share (its latency after stage 1, less what the dependent launch overlaps).
    pub stage1_ms: f64,
    pub p10_ms: f64,
    pub p90_ms: f64,
    pub kv_bytes: u64,
    /// KV + queries + partials (written and read) + outputs.
    pub bytes: u64,
    /// `bytes / median time`.
    pub achieved_gbps: f64,
    /// Achieved over the measured copy bandwidth.
    pub fraction_of_copy: f64,
    /// `bytes / copy bandwidth`.
    pub floor_ms: f64,
    /// KV bytes only over the copy bandwidth (the floor the batch goal names).
    pub kv_floor_ms: f64,
    pub rel_error: Option<f64>,
}

/// Times one decode step of `batch` requests of `seq_len` tokens.
#[allow(clippy::too_many_arguments)]
pub fn bench_point(
    backend: &CudaBackend,
    shape: &AttnShape,
    dtype: DType,
    seq_len: u32,
    batch: u32,
    iters: usize,
    copy_bw: f64,
    check: bool,
    seed: u64,
) -> canopy_engine::Result<KernelPoint> {
    let spec = WorkloadSpec::load("long")?.with_overrides(Overrides {
        seq_len: Some(seq_len),
        batch: Some(batch),
        prompt_len: None,
    })?;
    let tree = spec.build_tree()?;
    let shard = Shard::whole(&tree);
    // One group per request; the backend splits it to fill the GPU in one wave.
    let cfg = PlannerConfig::whole_paths();
    let host_plan = plan(&TreeView::new(&tree, &shard), Method::QGuided, shape, &cfg)?;
    let tokens = tree.total_tokens() as usize;
    let mut kv = backend.alloc_kv(shape, dtype, tokens)?;
    backend.fill_random(&mut kv, 0, tokens, seed, 0)?;
    let q_host = hashed_queries(shape, dtype, tree.num_queries(), seed);
    let q = backend.upload_queries(shape, &q_host)?;
    let dplan = backend.upload_plan(shape, &host_plan)?;
    let mut partials = backend.alloc_partials(shape, &dplan)?;
    let mut out = backend.alloc_states(shape, tree.num_queries())?;
    // Warm, as the decode-kernel tables in docs/BENCHMARKS.md were taken: their contexts are
    // read at the copy bandwidth, from HBM, once they outgrow L2.
    let times = backend.time_ms(iters, Cache::Warm, || {
        backend.step(&kv, &q, &dplan, &mut partials, &mut out)
    })?;
    let stage1 = backend.time_ms(iters, Cache::Warm, || {
        backend.run_plan(&kv, &q, &dplan, &mut partials)
    })?;
    let io = dplan.plan().io(shape, dtype);
    let f32_q_bytes = io.partial_rows as u64 * shape.q_row_elems() as u64 * 4;
    let out_bytes =
        tree.num_queries() as u64 * shape.q_heads as u64 * (shape.head_dim as u64 + 1) * 4;
    let bytes = io.kv_bytes + f32_q_bytes + io.partial_bytes + out_bytes;
    let med = median(&times);
    let rel_error = if check {
        let got = backend.download(&out)?;
        let oracle = hashed_oracle(&tree, shape, dtype, seed);
        Some(relative_error(&got.o, &oracle))
    } else {
        None
    };
    Ok(KernelPoint {
        seq_len,
        batch,
        groups: io.groups,
        median_ms: med,
        stage1_ms: median(&stage1),
        p10_ms: quantile(&times, 0.1),
        p90_ms: quantile(&times, 0.9),
        kv_bytes: io.kv_bytes,
        bytes,
        achieved_gbps: bytes as f64 / (med * 1e-3) / 1e9,
        fraction_of_copy: bytes as f64 / (med * 1e-3) / copy_bw,
        floor_ms: bytes as f64 / copy_bw * 1e3,
        kv_floor_ms: io.kv_bytes as f64 / copy_bw * 1e3,
        rel_error,
    })
}

/// The copy bandwidth, measured on buffers of 2 GiB (far beyond L2).
pub fn measure_copy_bandwidth(backend: &CudaBackend) -> Result<f64> {
    backend.copy_bandwidth(2 << 30, 20)
}
