//! Decoding across the GPUs of one process, tree and ring: one thread, one [`CudaBackend`] and
//! one NCCL communicator per GPU (the zero-setup default).
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
//! The ring baseline: KV shards travel around the ring with NCCL send/recv (grouped, so the
//! send to the next rank and the receive from the previous one proceed together) on a second
//! stream, double-buffered and overlapped with the partial kernel on the compute stream (events
//! order the two: a buffer is overwritten only after the kernel that read it, and a kernel reads
//! a buffer only after it arrived). Each rank folds every shard's states into its own output, so
//! every rank ends with the full result, as in tree decoding.
//!
//! Every rank ends with the exact output. Timings are CUDA events on rank 0's compute stream
//! around whole steps, with every step enqueued before any is waited on.

use crate::backend::{CudaBackend, CudaKv, CudaPlan, Kernel};
use crate::error::{CudaError, DriverContext, Result};
use canopy_core::data::{hashed_queries, HashedKv};
use canopy_core::stats::{median, quantile};
use canopy_core::{
    plan, reference_attention, relative_error, shard_tree, AttnShape, DType, Method, Overrides,
    PlannerConfig, TreeView, WorkloadSpec,
};
use canopy_engine::{ring_buffers, Backend, MergeCollective, Strategy};
use cudarc::driver::{CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nccl::{Comm, Id, ReduceOp};
use serde::Serialize;

/// Rank 0's step timings (ms), final outputs and (ring) measured link bandwidth in bytes per
/// second; other ranks return `None`.
type RankOutcome = canopy_engine::Result<Option<(Vec<f64>, Vec<f32>, Option<f64>)>>;

/// One measured configuration of distributed decoding.
#[derive(Debug, Clone, Serialize)]
pub struct DistributedReport {
    pub strategy: String,
    pub ranks: usize,
    pub seq_len: u32,
    pub batch: u32,
    pub median_ms: f64,
    pub p10_ms: f64,
    pub p90_ms: f64,
    /// Largest shard's K and V bytes.
    pub kv_bytes_per_rank: u64,
    /// Bytes each rank sends per step (tree: by NCCL's ring formulas; ring: the KV shards).
    pub comm_bytes_per_rank: u64,
    /// Ring: the NCCL send/recv bandwidth per rank measured alone on the same buffers
    /// (bytes sent per second), the ring's floor is `comm_bytes_per_rank / link`.
    pub link_gbps: Option<f64>,
    pub rel_error: Option<f64>,
}

/// What to run.
#[derive(Debug, Clone)]
pub struct DistributedConfig {
    pub ranks: usize,
    pub strategy: Strategy,
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

/// The problem every rank derives from `cfg`: the tree and its shards.
fn problem(
    cfg: &DistributedConfig,
) -> canopy_engine::Result<(canopy_core::KvTree, Vec<canopy_core::Shard>)> {
    let spec = WorkloadSpec::load("long")?.with_overrides(Overrides {
        seq_len: Some(cfg.seq_len),
        batch: Some(cfg.batch),
        prompt_len: None,
    })?;
    let tree = spec.build_tree()?;
    let shards = shard_tree(&tree, cfg.ranks)?;
    Ok((tree, shards))
}

/// Refuses configurations this machine cannot run, before anything is allocated.
fn check_machine(cfg: &DistributedConfig, gpus_needed: usize) -> canopy_engine::Result<()> {
    let gpus = crate::probe::device_count()?;
    if cfg.ranks == 0 || gpus_needed > gpus {
        return Err(CudaError::Unsupported(format!(
            "{} ranks need {gpus_needed} GPUs on this node but {gpus} are visible; lower the rank count",
            cfg.ranks
        ))
        .into());
    }
    if !crate::probe::nccl_present() && cfg.ranks > 1 {
        return Err(CudaError::Unsupported(
            "NCCL (libnccl.so.2) could not be loaded; install NCCL or use one rank".into(),
        )
        .into());
    }
    Ok(())
}

/// One rank on GPU `gpu`: joins the NCCL communicator `id` and runs the strategy.
fn rank_body(
    cfg: &DistributedConfig,
    rank: usize,
    gpu: usize,
    id: Id,
    tree: &canopy_core::KvTree,
    shards: &[canopy_core::Shard],
) -> RankOutcome {
    let backend = CudaBackend::new(gpu)?;
    // The tree's collectives run in order on the compute stream; the ring's transfers run on
    // their own stream, to overlap the kernels.
    let comm_stream = match cfg.strategy {
        Strategy::Tree(_) => backend.stream().clone(),
        Strategy::Ring => backend
            .stream()
            .context()
            .new_stream()
            .ctx("cuStreamCreate")?,
    };
    let comm =
        Comm::from_rank(comm_stream, rank, cfg.ranks, id).map_err(nccl("ncclCommInitRank"))?;
    match cfg.strategy {
        Strategy::Tree(how) => rank_steps(&backend, &comm, cfg, how, tree, &shards[rank]),
        Strategy::Ring => ring_steps(&backend, &comm, cfg, tree, shards),
    }
}

/// Runs `cfg` on GPUs `0..cfg.ranks`, one thread each, and reports rank 0's timings.
pub fn run(cfg: &DistributedConfig) -> canopy_engine::Result<DistributedReport> {
    check_machine(cfg, cfg.ranks)?;
    let (tree, shards) = problem(cfg)?;
    let id = Id::new().map_err(nccl("ncclGetUniqueId"))?;
    let results: Vec<RankOutcome> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..cfg.ranks)
            .map(|rank| {
                let (tree, shards) = (&tree, &shards);
                scope.spawn(move || rank_body(cfg, rank, rank, id, tree, shards))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a rank thread panicked"))
            .collect()
    });
    let mut rank0 = None;
    for r in results {
        if let Some(t) = r? {
            rank0 = Some(t);
        }
    }
    Ok(finish(cfg, &tree, &shards, rank0.expect("rank 0 reports")))
}

/// One process per GPU under mpirun/srun: this process is rank `comm.rank()` of `cfg.ranks`
/// (the MPI world size) and drives the GPU of its node-local rank; rank 0's NCCL id reaches
/// every rank over MPI. Rank 0 returns the report.
#[cfg(feature = "mpi")]
pub fn run_mpi(
    cfg: &DistributedConfig,
    comm: &canopy_comm::MpiComm,
) -> canopy_engine::Result<Option<DistributedReport>> {
    use canopy_comm::Collective;
    let local = comm.local_rank();
    check_machine(cfg, local + 1)?;
    let (tree, shards) = problem(cfg)?;
    let mine = if comm.rank() == 0 {
        Some(Id::new().map_err(nccl("ncclGetUniqueId"))?)
    } else {
        None
    };
    let bytes: Vec<u8> = mine.map_or(vec![0u8; 128], |id| {
        id.internal().iter().map(|&c| c as u8).collect()
    });
    let mut all = vec![0u8; 128 * comm.size()];
    comm.all_gather(&bytes, &mut all)?;
    let internal: [std::ffi::c_char; 128] = std::array::from_fn(|i| all[i] as std::ffi::c_char);
    let outcome = rank_body(
        cfg,
        comm.rank(),
        local,
        Id::uninit(internal),
        &tree,
        &shards,
    )?;
    comm.barrier()?;
    Ok(outcome.map(|rank0| finish(cfg, &tree, &shards, rank0)))
}

/// Rank 0's timings and output, checked against the oracle, as a report.
fn finish(
    cfg: &DistributedConfig,
    tree: &canopy_core::KvTree,
    shards: &[canopy_core::Shard],
    rank0: (Vec<f64>, Vec<f32>, Option<f64>),
) -> DistributedReport {
    let (times, out, link) = rank0;
    let rel_error = cfg.check.then(|| {
        let q = hashed_queries(&cfg.shape, cfg.dtype, tree.num_queries(), cfg.seed);
        let kv = HashedKv {
            seed: cfg.seed,
            dtype: cfg.dtype,
            kv_heads: cfg.shape.kv_heads,
        };
        relative_error(&out, &reference_attention(tree, &cfg.shape, &q, &kv).0)
    });
    let cells = (tree.num_queries() * cfg.shape.q_heads) as u64;
    let token_bytes = 2 * cfg.shape.kv_token_bytes(cfg.dtype) as u64;
    let comm_bytes_per_rank = match cfg.strategy {
        _ if cfg.ranks == 1 => 0,
        Strategy::Tree(how) => merge_traffic(how, cfg.ranks, cells, cfg.shape.head_dim as u64),
        // Rank r sends every shard but the one before it: the (p - 1) largest is the bound.
        Strategy::Ring => {
            let mut sizes: Vec<u64> = shards
                .iter()
                .map(|s| s.tokens() as u64 * token_bytes)
                .collect();
            sizes.sort_unstable();
            sizes[1..].iter().sum()
        }
    };
    DistributedReport {
        strategy: cfg.strategy.name(),
        ranks: cfg.ranks,
        seq_len: cfg.seq_len,
        batch: cfg.batch,
        median_ms: median(&times),
        p10_ms: quantile(&times, 0.1),
        p90_ms: quantile(&times, 0.9),
        kv_bytes_per_rank: shards.iter().map(|s| s.tokens() as u64).max().unwrap_or(0)
            * token_bytes,
        comm_bytes_per_rank,
        link_gbps: link.map(|bps| bps / 1e9),
        rel_error,
    }
}

/// KV of `shard`, generated in place on this rank's GPU (windows back to back).
fn load_shard(
    backend: &CudaBackend,
    cfg: &DistributedConfig,
    shard: &canopy_core::Shard,
    capacity: usize,
) -> Result<CudaKv> {
    let mut kv = backend.alloc_kv(&cfg.shape, cfg.dtype, capacity)?;
    let mut at = 0usize;
    for w in &shard.windows {
        let n = (w.end - w.start) as usize;
        backend.fill_random(&mut kv, at, n, cfg.seed, w.start as u64)?;
        at += n;
    }
    Ok(kv)
}

/// `shard`'s plan (one group per request; the backend splits it to fill the GPU), in the
/// shard's compact addresses, uploaded.
fn shard_plan(
    backend: &CudaBackend,
    cfg: &DistributedConfig,
    tree: &canopy_core::KvTree,
    shard: &canopy_core::Shard,
) -> canopy_engine::Result<CudaPlan> {
    let single = PlannerConfig {
        q_guided_chunk: u32::MAX,
        ..PlannerConfig::default()
    };
    let local = shard.localize(&plan(
        &TreeView::new(tree, shard),
        Method::QGuided,
        &cfg.shape,
        &single,
    )?);
    backend.upload_plan(&cfg.shape, &local)
}

/// One tree rank: load its shard, then time `cfg.iters` decode steps.
fn rank_steps(
    backend: &CudaBackend,
    comm: &Comm,
    cfg: &DistributedConfig,
    how: MergeCollective,
    tree: &canopy_core::KvTree,
    shard: &canopy_core::Shard,
) -> RankOutcome {
    let shape = &cfg.shape;
    let kv = load_shard(backend, cfg, shard, shard.tokens() as usize)?;
    let q = backend.upload_queries(
        shape,
        &hashed_queries(shape, cfg.dtype, tree.num_queries(), cfg.seed),
    )?;
    let dplan = shard_plan(backend, cfg, tree, shard)?;
    let mut partials = backend.alloc_partials(shape, &dplan)?;
    let mut out = backend.alloc_states(shape, tree.num_queries())?;
    let mut merge = DeviceMerge::new(
        backend,
        tree.num_queries() * shape.q_heads,
        shape.head_dim,
        cfg.ranks,
    )?;
    let times = backend.time_ms(cfg.iters, || {
        backend.run_plan(&kv, &q, &dplan, &mut partials)?;
        backend.merge(&partials, &dplan, &mut out)?;
        merge.run(backend, comm, how, &mut out.o, &mut out.lse)
    })?;
    if comm.rank() != 0 {
        return Ok(None);
    }
    Ok(Some((times, backend.download(&out)?.o, None)))
}

/// Sends the first `tokens` tokens of `from` to `next` and receives `recv_tokens` tokens from
/// `prev` into `into`, as one NCCL group on the communicator's stream.
fn exchange(
    comm: &Comm,
    from: &CudaKv,
    tokens: usize,
    into: &mut CudaKv,
    recv_tokens: usize,
    next: usize,
    prev: usize,
) -> Result<()> {
    let (sb, rb) = (from.bytes_of(tokens), into.bytes_of(recv_tokens));
    cudarc::nccl::result::group_start().map_err(nccl("ncclGroupStart"))?;
    comm.send(&from.k.slice(0..sb), next as i32)
        .map_err(nccl("send(K)"))?;
    comm.send(&from.v.slice(0..sb), next as i32)
        .map_err(nccl("send(V)"))?;
    comm.recv(&mut into.k.slice_mut(0..rb), prev as i32)
        .map_err(nccl("recv(K)"))?;
    comm.recv(&mut into.v.slice_mut(0..rb), prev as i32)
        .map_err(nccl("recv(V)"))?;
    cudarc::nccl::result::group_end().map_err(nccl("ncclGroupEnd"))?;
    Ok(())
}

fn record(stream: &CudaStream) -> Result<cudarc::driver::CudaEvent> {
    stream.record_event(None).ctx("cuEventRecord")
}

/// One ring rank: time `cfg.iters` steps of p partial kernels, each on the shard that has just
/// arrived, while the next shard travels; then the NCCL exchange alone, for the link bandwidth.
fn ring_steps(
    backend: &CudaBackend,
    comm: &Comm,
    cfg: &DistributedConfig,
    tree: &canopy_core::KvTree,
    shards: &[canopy_core::Shard],
) -> RankOutcome {
    let shape = &cfg.shape;
    let (rank, p) = (comm.rank(), cfg.ranks);
    let (next, prev) = ((rank + 1) % p, (rank + p - 1) % p);
    let tokens: Vec<usize> = shards.iter().map(|s| s.tokens() as usize).collect();
    let max_tokens = tokens.iter().copied().max().unwrap_or(0);
    let own = load_shard(backend, cfg, &shards[rank], tokens[rank])?;
    let mut bufs = [
        backend.alloc_kv(shape, cfg.dtype, max_tokens)?,
        backend.alloc_kv(shape, cfg.dtype, max_tokens)?,
    ];
    let q = backend.upload_queries(
        shape,
        &hashed_queries(shape, cfg.dtype, tree.num_queries(), cfg.seed),
    )?;
    let plans = shards
        .iter()
        .map(|s| shard_plan(backend, cfg, tree, s))
        .collect::<canopy_engine::Result<Vec<_>>>()?;
    let mut partials = plans
        .iter()
        .map(|pl| backend.alloc_partials(shape, pl))
        .collect::<canopy_engine::Result<Vec<_>>>()?;
    let (mut acc, mut tmp) = (
        backend.alloc_states(shape, tree.num_queries())?,
        backend.alloc_states(shape, tree.num_queries())?,
    );
    let cells = (tree.num_queries() * shape.q_heads) as u32;
    let d = shape.head_dim as u32;
    let pair = backend.function(Kernel::Combine("combine_pair"))?;
    let (compute, transfer) = (backend.stream(), comm.stream());
    let times = backend.time_ms(cfg.iters, || {
        // `ready`: everything the compute stream has read so far; a buffer is received into
        // only after it, and a kernel reads a buffer only after its arrival event.
        let mut ready = record(compute)?;
        for s in 0..p {
            let src = (rank + p - s) % p;
            let (cur, spare) = ring_buffers(s, &own, &mut bufs);
            let arrived = if s + 1 < p {
                transfer.wait(&ready).ctx("cuStreamWaitEvent")?;
                exchange(
                    comm,
                    cur,
                    tokens[src],
                    spare,
                    tokens[(src + p - 1) % p],
                    next,
                    prev,
                )?;
                Some(record(&transfer)?)
            } else {
                None
            };
            let out = if s == 0 { &mut acc } else { &mut tmp };
            backend.run_plan(cur, &q, &plans[src], &mut partials[src])?;
            backend.merge(&partials[src], &plans[src], out)?;
            if s > 0 {
                let mut b = compute.launch_builder(&pair);
                b.arg(&mut acc.o)
                    .arg(&mut acc.lse)
                    .arg(&tmp.o)
                    .arg(&tmp.lse)
                    .arg(&d);
                let grid = LaunchConfig {
                    grid_dim: (cells.max(1), 1, 1),
                    block_dim: (d.min(128), 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: one block per cell; reads and writes cells × d outputs and cells lse.
                unsafe { b.launch(grid) }.ctx("launching combine_pair")?;
            }
            ready = record(compute)?;
            if let Some(ev) = arrived {
                compute.wait(&ev).ctx("cuStreamWaitEvent")?;
            }
        }
        Ok(())
    })?;
    // The exchange alone on the same buffers: the link bandwidth the ring's floor divides by.
    let link = if p > 1 {
        use cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
        transfer.wait(&record(compute)?).ctx("cuStreamWaitEvent")?;
        let mut exchange_own = || {
            exchange(
                comm,
                &own,
                tokens[rank],
                &mut bufs[0],
                tokens[prev],
                next,
                prev,
            )
        };
        exchange_own()?; // warm-up
        let start = transfer
            .record_event(Some(CU_EVENT_DEFAULT))
            .ctx("cuEventRecord")?;
        let reps = cfg.iters.max(1);
        for _ in 0..reps {
            exchange_own()?;
        }
        let end = transfer
            .record_event(Some(CU_EVENT_DEFAULT))
            .ctx("cuEventRecord")?;
        let ms = start.elapsed_ms(&end).ctx("cuEventElapsedTime")? as f64 / reps as f64;
        Some(2.0 * own.bytes_of(tokens[rank]) as f64 / (ms * 1e-3))
    } else {
        None
    };
    if rank != 0 {
        return Ok(None);
    }
    Ok(Some((times, backend.download(&acc)?.o, link)))
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
