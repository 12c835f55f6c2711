//! Tree Attention across the GPUs of one process: one thread, one [`CudaBackend`] and one NCCL
//! communicator per GPU (the zero-setup default; `mpirun` runs the same per-rank code).
//!
//! Each rank holds a contiguous shard of every sequence (`canopy_core::shard_tree`), generated
//! in place on its GPU, and a decode step is:
//! 1. `decode_partial` + `merge_partials` on the shard: one (o, lse) state per query and head;
//! 2. the cross-rank merge, entirely on the device and on the same stream:
//!    - `allreduce3` (the paper's Algorithm 3): MAX of lse, then SUM of the numerator and SUM of
//!      the denominator;
//!    - `allreduce2`: MAX, then one SUM of numerator and denominator packed together;
//!    - `allgather`: one all-gather of (o, lse) and a fold in rank order.
//!
//! Every rank ends with the exact output. Timings are CUDA events on rank 0's stream around
//! whole steps, with every step enqueued before any is waited on.

use crate::backend::{CudaBackend, Kernel};
use crate::bench::{median, quantile};
use crate::error::{CudaError, DriverContext, Result};
use canopy_core::data::{hashed_queries, HashedKv};
use canopy_core::{
    plan, reference_attention, relative_error, shard_tree, AttnShape, DType, Method, Overrides,
    PlannerConfig, TreeView, WorkloadSpec,
};
use canopy_engine::{Backend, MergeCollective};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use cudarc::nccl::{Comm, Id, ReduceOp};
use serde::Serialize;

/// Rank 0's step timings (ms) and final outputs; other ranks return `None`.
type RankOutcome = canopy_engine::Result<Option<(Vec<f64>, Vec<f32>)>>;

/// One measured configuration of distributed tree decoding.
#[derive(Debug, Clone, Serialize)]
pub struct TreeRunReport {
    pub collective: MergeCollective,
    pub ranks: usize,
    pub seq_len: u32,
    pub batch: u32,
    pub median_ms: f64,
    pub p10_ms: f64,
    pub p90_ms: f64,
    /// Largest shard's K and V bytes.
    pub kv_bytes_per_rank: u64,
    /// Bytes each rank sends per step, by NCCL's ring formulas.
    pub comm_bytes_per_rank: u64,
    pub rel_error: Option<f64>,
}

/// What to run.
#[derive(Debug, Clone)]
pub struct TreeRunConfig {
    pub ranks: usize,
    pub collective: MergeCollective,
    pub shape: AttnShape,
    pub dtype: DType,
    pub seq_len: u32,
    pub batch: u32,
    pub iters: usize,
    pub check: bool,
    pub seed: u64,
}

fn nccl(context: &str) -> impl Fn(cudarc::nccl::result::NcclError) -> CudaError + '_ {
    move |e| CudaError::Unsupported(format!("NCCL {context} failed: {e:?}"))
}

/// Bytes one rank sends per step for the merge of `cells` states of dimension `d`.
fn merge_traffic(how: MergeCollective, ranks: usize, cells: u64, d: u64) -> u64 {
    let p = ranks as u64;
    let all_reduce = |bytes: u64| 2 * (p - 1) * bytes / p;
    match how {
        MergeCollective::Allreduce3 => all_reduce(cells * 4) * 2 + all_reduce(cells * d * 4),
        MergeCollective::Allreduce2 => all_reduce(cells * 4) + all_reduce(cells * (d + 1) * 4),
        MergeCollective::Allgather => (p - 1) * cells * (d + 1) * 4,
    }
}

/// Runs `cfg` on GPUs `0..cfg.ranks` and reports rank 0's timings.
pub fn tree_attention(cfg: &TreeRunConfig) -> canopy_engine::Result<TreeRunReport> {
    let gpus = crate::probe::device_count()?;
    if cfg.ranks == 0 || cfg.ranks > gpus {
        return Err(CudaError::Unsupported(format!(
            "{} ranks need {} GPUs but {gpus} are visible; lower --ranks",
            cfg.ranks, cfg.ranks
        ))
        .into());
    }
    if !crate::probe::nccl_present() && cfg.ranks > 1 {
        return Err(CudaError::Unsupported(
            "NCCL (libnccl.so.2) could not be loaded; install NCCL or use --ranks 1".into(),
        )
        .into());
    }
    let spec = WorkloadSpec::load("long")?.with_overrides(Overrides {
        seq_len: Some(cfg.seq_len),
        batch: Some(cfg.batch),
        prompt_len: None,
    })?;
    let tree = spec.build_tree()?;
    let shards = shard_tree(&tree, cfg.ranks)?;
    let id = Id::new().map_err(nccl("ncclGetUniqueId"))?;
    let results: Vec<RankOutcome> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..cfg.ranks)
            .map(|rank| {
                let (tree, shard) = (&tree, &shards[rank]);
                scope.spawn(
                    move || -> canopy_engine::Result<Option<(Vec<f64>, Vec<f32>)>> {
                        let backend = CudaBackend::new(rank)?;
                        let comm = Comm::from_rank(backend.stream().clone(), rank, cfg.ranks, id)
                            .map_err(nccl("ncclCommInitRank"))?;
                        rank_steps(&backend, &comm, cfg, tree, shard)
                    },
                )
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a rank thread panicked"))
            .collect()
    });
    let mut timings = None;
    for r in results {
        if let Some(t) = r? {
            timings = Some(t);
        }
    }
    let (times, out) = timings.expect("rank 0 reports");
    let rel_error = cfg.check.then(|| {
        let q = hashed_queries(&cfg.shape, cfg.dtype, tree.num_queries(), cfg.seed);
        let kv = HashedKv {
            seed: cfg.seed,
            dtype: cfg.dtype,
            kv_heads: cfg.shape.kv_heads,
        };
        relative_error(&out, &reference_attention(&tree, &cfg.shape, &q, &kv).0)
    });
    let cells = (tree.num_queries() * cfg.shape.q_heads) as u64;
    let token_bytes = 2 * (cfg.shape.kv_token_elems() * cfg.dtype.size_bytes()) as u64;
    Ok(TreeRunReport {
        collective: cfg.collective,
        ranks: cfg.ranks,
        seq_len: cfg.seq_len,
        batch: cfg.batch,
        median_ms: median(&times),
        p10_ms: quantile(&times, 0.1),
        p90_ms: quantile(&times, 0.9),
        kv_bytes_per_rank: shards.iter().map(|s| s.tokens() as u64).max().unwrap_or(0)
            * token_bytes,
        comm_bytes_per_rank: if cfg.ranks > 1 {
            merge_traffic(cfg.collective, cfg.ranks, cells, cfg.shape.head_dim as u64)
        } else {
            0
        },
        rel_error,
    })
}

/// One rank: load its shard, then time `cfg.iters` decode steps. Rank 0 returns its timings and
/// final output.
fn rank_steps(
    backend: &CudaBackend,
    comm: &Comm,
    cfg: &TreeRunConfig,
    tree: &canopy_core::KvTree,
    shard: &canopy_core::Shard,
) -> RankOutcome {
    let shape = &cfg.shape;
    let mut kv = backend.alloc_kv(shape, cfg.dtype, shard.tokens() as usize)?;
    let mut at = 0usize;
    for w in &shard.windows {
        let n = (w.end - w.start) as usize;
        backend.fill_random(&mut kv, at, n, cfg.seed, w.start as u64)?;
        at += n;
    }
    let q = backend.upload_queries(
        shape,
        &hashed_queries(shape, cfg.dtype, tree.num_queries(), cfg.seed),
    )?;
    let single = PlannerConfig {
        q_guided_chunk: u32::MAX,
        ..PlannerConfig::default()
    };
    let local = shard.localize(&plan(
        &TreeView::new(tree, shard),
        Method::QGuided,
        shape,
        &single,
    )?);
    let dplan = backend.upload_plan(shape, &local)?;
    let mut partials = backend.alloc_partials(shape, &dplan)?;
    let mut out = backend.alloc_states(shape, tree.num_queries())?;
    let cells = tree.num_queries() * shape.q_heads;
    let d = shape.head_dim;
    let mut merge = DeviceMerge::new(backend, cells, d, cfg.ranks)?;
    let times = backend.time_ms(cfg.iters, || {
        backend
            .run_plan(&kv, &q, &dplan, &mut partials)
            .map_err(|e| CudaError::Unsupported(e.to_string()))?;
        backend
            .merge(&partials, &dplan, &mut out)
            .map_err(|e| CudaError::Unsupported(e.to_string()))?;
        merge.run(backend, comm, cfg.collective, &mut out.o, &mut out.lse)
    })?;
    if comm.rank() != 0 {
        return Ok(None);
    }
    let host = backend.download(&out)?;
    Ok(Some((times, host.o)))
}

/// Device buffers and launches of the cross-rank merge.
struct DeviceMerge {
    cells: u32,
    d: u32,
    ranks: usize,
    max: CudaSlice<f32>,
    packed: CudaSlice<f32>,
    gathered: CudaSlice<f32>,
}

impl DeviceMerge {
    fn new(backend: &CudaBackend, cells: usize, d: usize, ranks: usize) -> Result<DeviceMerge> {
        Ok(DeviceMerge {
            cells: cells as u32,
            d: d as u32,
            ranks,
            max: backend.alloc(cells)?,
            packed: backend.alloc(cells * (d + 1))?,
            gathered: backend.alloc(ranks * cells * (d + 1))?,
        })
    }

    /// A grid-stride launch over the cells × (d + 1) elements of a combine kernel.
    fn grid(&self, backend: &CudaBackend) -> LaunchConfig {
        let n = self.cells as u64 * (self.d as u64 + 1);
        let blocks = n
            .div_ceil(256)
            .min(4 * backend.gpu().multiprocessors as u64)
            .max(1) as u32;
        LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// Replaces this rank's (o, lse) with the merge over all ranks.
    fn run(
        &mut self,
        backend: &CudaBackend,
        comm: &Comm,
        how: MergeCollective,
        o: &mut CudaSlice<f32>,
        lse: &mut CudaSlice<f32>,
    ) -> Result<()> {
        if self.ranks == 1 {
            return Ok(());
        }
        let stream = backend.stream();
        let (cells, d) = (self.cells, self.d);
        let n = cells as usize * d as usize;
        match how {
            MergeCollective::Allreduce3 | MergeCollective::Allreduce2 => {
                stream
                    .memcpy_dtod(&lse.slice(0..cells as usize), &mut self.max)
                    .ctx("cuMemcpyDtoD")?;
                comm.all_reduce_in_place(&mut self.max, &ReduceOp::Max)
                    .map_err(nccl("all_reduce(max)"))?;
                let grid = self.grid(backend);
                let f = backend.function(Kernel::Combine("combine_weights"))?;
                let mut b = stream.launch_builder(&f);
                b.arg(&*o)
                    .arg(&*lse)
                    .arg(&self.max)
                    .arg(&mut self.packed)
                    .arg(&cells)
                    .arg(&d);
                // SAFETY: reads cells × (d + 1) floats and writes as many into `packed`.
                unsafe { b.launch(grid) }.ctx("launching combine_weights")?;
                if how == MergeCollective::Allreduce3 {
                    comm.all_reduce_in_place(&mut self.packed.slice_mut(0..n), &ReduceOp::Sum)
                        .map_err(nccl("all_reduce(numerator)"))?;
                    comm.all_reduce_in_place(
                        &mut self.packed.slice_mut(n..n + cells as usize),
                        &ReduceOp::Sum,
                    )
                    .map_err(nccl("all_reduce(denominator)"))?;
                } else {
                    comm.all_reduce_in_place(&mut self.packed, &ReduceOp::Sum)
                        .map_err(nccl("all_reduce(packed)"))?;
                }
                let f = backend.function(Kernel::Combine("combine_finish"))?;
                let mut b = stream.launch_builder(&f);
                b.arg(&self.packed)
                    .arg(&self.max)
                    .arg(&mut *o)
                    .arg(&mut *lse)
                    .arg(&cells)
                    .arg(&d);
                // SAFETY: reads `packed` and `max`, writes cells × d outputs and cells lse.
                unsafe { b.launch(grid) }.ctx("launching combine_finish")?;
            }
            MergeCollective::Allgather => {
                stream
                    .memcpy_dtod(&o.slice(0..n), &mut self.packed.slice_mut(0..n))
                    .ctx("cuMemcpyDtoD")?;
                stream
                    .memcpy_dtod(
                        &lse.slice(0..cells as usize),
                        &mut self.packed.slice_mut(n..n + cells as usize),
                    )
                    .ctx("cuMemcpyDtoD")?;
                comm.all_gather(&self.packed, &mut self.gathered)
                    .map_err(nccl("all_gather"))?;
                let ranks = self.ranks as u32;
                let f = backend.function(Kernel::Combine("combine_gathered"))?;
                let mut b = stream.launch_builder(&f);
                b.arg(&self.gathered)
                    .arg(&ranks)
                    .arg(&mut *o)
                    .arg(&mut *lse)
                    .arg(&cells)
                    .arg(&d);
                // SAFETY: reads ranks × cells × (d + 1) gathered floats, writes one state per cell.
                unsafe { b.launch(self.grid(backend)) }.ctx("launching combine_gathered")?;
            }
        }
        Ok(())
    }
}
