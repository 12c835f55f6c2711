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
//!    - `allgather`: one all-gather of (o, lse) and a fold in rank order;
//!    - `hierarchical`: MAX and a reduce inside each node, the fused all-reduce among node
//!      leaders only, then a broadcast inside each node (sub-communicators per node and for
//!      the leaders);
//!    - `auto`: one of these, chosen by the cost model after timing this world's all-reduce
//!      and all-gather at the merge's sizes.
//!
//! The ring baseline: KV shards travel around the ring with NCCL send/recv (grouped, so the
//! send to the next rank and the receive from the previous one proceed together) on a second
//! stream, double-buffered and overlapped with the partial kernel on the compute stream (events
//! order the two: a buffer is overwritten only after the kernel that read it, and a kernel reads
//! a buffer only after it arrived). Each rank folds every shard's states into its own output, so
//! every rank ends with the full result, as in tree decoding.
//!
//! Every rank ends with the exact output. Timings are CUDA events on rank 0's compute stream
//! around whole steps, with every step enqueued before any is waited on. Every wait goes
//! through a [`Watchdog`]: a dead or stalled peer ends each rank within `timeout` with an error
//! naming the rank and the NCCL call, never a hang.

mod merge;

use crate::error::{CudaError, DriverContext, Result};
use crate::nccl::{connect_at_init, group, NcclComm, Watchdog};
use crate::timing::WARMUP_STEPS;
use crate::{CudaBackend, CudaKv, CudaPlan, KernelChoice};
use canopy_core::data::{hashed_oracle, hashed_queries};
use canopy_core::workload::build_tree;
use canopy_core::{
    plan, relative_error, shard_tree, AttnShape, DType, KvTree, Method, Overrides, PlannerConfig,
    Shard, TreeSpec, TreeView, WorkloadSpec,
};
use canopy_engine::{
    ring_buffers, Backend, Cache, Measured, MergeCollective, MergeOps, NodeLayout, RunReport,
    Strategy,
};
use cudarc::driver::CudaStream;
use cudarc::nccl::Id;
use merge::DeviceMerge;
use std::time::Duration;

/// What one rank reports: rank 0 also its step timings (ms), outputs and (ring) the link
/// bandwidth measured alone, in bytes sent per second.
struct RankOutput {
    rank0: Option<(Vec<f64>, Vec<f32>, Option<f64>)>,
    peak_bytes: u64,
    wire_bytes_per_step: u64,
    chosen: Option<MergeCollective>,
}

type RankOutcome = canopy_engine::Result<RankOutput>;

/// What to run.
#[derive(Debug, Clone)]
pub struct DistributedConfig {
    pub ranks: usize,
    pub strategy: Strategy,
    pub shape: AttnShape,
    pub dtype: DType,
    pub seq_len: u32,
    pub batch: u32,
    /// A tree workload and the method each rank plans its part with, instead of `batch`
    /// sequences of `seq_len` tokens.
    pub tree: Option<(TreeSpec, Method)>,
    /// The stage-1 kernel each rank runs.
    pub kernel: KernelChoice,
    pub iters: usize,
    /// What each timed step finds in L2.
    pub cache: Cache,
    pub check: bool,
    pub seed: u64,
    /// Cut the ranks into this many virtual nodes for `hierarchical` (default: hosts).
    pub virtual_nodes: Option<usize>,
    /// How long a rank waits for a step before its watchdog aborts the communicators.
    pub timeout: Duration,
    /// Fault injection (tests of the watchdog): this rank stops before its first step, as if
    /// it had died.
    pub stall_rank: Option<usize>,
}

/// The problem every rank derives from `cfg`: the tree and its shards.
fn problem(cfg: &DistributedConfig) -> canopy_engine::Result<(KvTree, Vec<Shard>)> {
    let tree = match &cfg.tree {
        Some((spec, _)) => build_tree(spec)?,
        None => WorkloadSpec::load("long")?
            .with_overrides(Overrides {
                seq_len: Some(cfg.seq_len),
                batch: Some(cfg.batch),
                prompt_len: None,
            })?
            .build_tree()?,
    };
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

/// The NCCL unique ids of one run: the world, each node, and the node leaders.
#[derive(Clone)]
struct CommIds {
    world: Id,
    nodes: Vec<Id>,
    leaders: Id,
}

impl CommIds {
    fn new(nodes: usize) -> Result<CommIds> {
        let id = || Id::new().map_err(|e| nccl_error("ncclGetUniqueId", e));
        Ok(CommIds {
            world: id()?,
            nodes: (0..nodes).map(|_| id()).collect::<Result<_>>()?,
            leaders: id()?,
        })
    }

    #[cfg(feature = "mpi")]
    fn to_bytes(&self) -> Vec<u8> {
        std::iter::once(&self.world)
            .chain(&self.nodes)
            .chain([&self.leaders])
            .flat_map(|id| id.internal().iter().map(|&c| c as u8))
            .collect()
    }

    #[cfg(feature = "mpi")]
    fn from_bytes(bytes: &[u8]) -> CommIds {
        let mut ids: Vec<Id> = bytes
            .chunks(128)
            .map(|c| Id::uninit(std::array::from_fn(|i| c[i] as std::ffi::c_char)))
            .collect();
        let leaders = ids.pop().expect("a leaders id");
        let world = ids.remove(0);
        CommIds {
            world,
            nodes: ids,
            leaders,
        }
    }
}

fn nccl_error(call: &'static str, e: cudarc::nccl::result::NcclError) -> CudaError {
    CudaError::Nccl {
        rank: 0,
        call,
        detail: format!("{:?}", e.0),
    }
}

/// A rank's communicators: the world's, and for the hierarchical merge its node's and (on
/// leaders) the leaders'.
struct RankComms {
    world: NcclComm,
    node: Option<NcclComm>,
    leaders: Option<NcclComm>,
}

impl RankComms {
    fn all(&self) -> Vec<&NcclComm> {
        std::iter::once(&self.world)
            .chain(&self.node)
            .chain(&self.leaders)
            .collect()
    }

    fn wire_bytes(&self) -> u64 {
        self.all().iter().map(|c| c.wire_bytes()).sum()
    }
}

/// One rank on GPU `gpu`: joins the communicators and runs the strategy.
fn rank_body(
    cfg: &DistributedConfig,
    rank: usize,
    gpu: usize,
    ids: &CommIds,
    layout: &NodeLayout,
    tree: &KvTree,
    shards: &[Shard],
) -> RankOutcome {
    let backend = CudaBackend::new(gpu)?.with_kernel(cfg.kernel);
    // From here a rank that waits for its peers (NCCL's set-up included) is watched.
    let watchdog = Watchdog::start(rank, cfg.timeout);
    check_fits(&backend, cfg, shards)?;
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
    let world = NcclComm::new(comm_stream, rank, cfg.ranks, &ids.world)?;
    let (node, leaders) = if cfg.strategy == Strategy::Tree(MergeCollective::Hierarchical) {
        let n = layout.node_of(rank);
        let members = layout.members(n);
        let local = members.iter().position(|&r| r == rank).expect("a member");
        let stream = backend.stream().clone();
        let node = NcclComm::new(stream.clone(), local, members.len(), &ids.nodes[n])?;
        let leaders = match layout.leaders().iter().position(|&l| l == rank) {
            Some(i) => Some(NcclComm::new(stream, i, layout.nodes(), &ids.leaders)?),
            None => None,
        };
        (Some(node), leaders)
    } else {
        (None, None)
    };
    let comms = RankComms {
        world,
        node,
        leaders,
    };
    if cfg.stall_rank == Some(rank) {
        return Err(CudaError::Unsupported(format!(
            "rank {rank}: stopped before its first step (fault injected with --stall-rank)"
        ))
        .into());
    }
    match cfg.strategy {
        Strategy::Tree(how) => rank_steps(
            &backend,
            &comms,
            &watchdog,
            cfg,
            how,
            layout,
            tree,
            &shards[rank],
        ),
        Strategy::Ring => ring_steps(&backend, &comms.world, &watchdog, cfg, tree, shards),
    }
}

/// Refuses shards whose KV buffers (the shard; the ring also two receive buffers) do not fit
/// in this GPU's free memory, before anything is allocated.
fn check_fits(backend: &CudaBackend, cfg: &DistributedConfig, shards: &[Shard]) -> Result<()> {
    let token_bytes = 2 * cfg.shape.kv_token_bytes(cfg.dtype) as u64;
    let shard = shards.iter().map(|s| s.tokens() as u64).max().unwrap_or(0) * token_bytes;
    let buffers = match cfg.strategy {
        Strategy::Ring if cfg.ranks > 1 => 3,
        _ => 1,
    };
    let need = shard * buffers;
    let free = backend.free_bytes()?;
    if need > free {
        return Err(CudaError::Unsupported(format!(
            "{} needs {:.1} GiB of KV buffers per rank but GPU {} has {:.1} GiB free; use more ranks or a shorter context",
            cfg.strategy.name(),
            need as f64 / (1u64 << 30) as f64,
            backend.gpu().ordinal,
            free as f64 / (1u64 << 30) as f64
        )));
    }
    Ok(())
}

/// The node layout of a single-process run: one host, or the requested virtual nodes.
fn local_layout(cfg: &DistributedConfig) -> canopy_engine::Result<NodeLayout> {
    match cfg.virtual_nodes {
        Some(k) => NodeLayout::virtual_nodes(cfg.ranks, k),
        None => Ok(NodeLayout::single(cfg.ranks)),
    }
}

/// Runs `cfg` on GPUs `0..cfg.ranks`, one thread each, and reports rank 0's timings.
pub fn run(cfg: &DistributedConfig) -> canopy_engine::Result<RunReport> {
    check_machine(cfg, cfg.ranks)?;
    connect_at_init();
    let (tree, shards) = problem(cfg)?;
    let layout = local_layout(cfg)?;
    let ids = CommIds::new(layout.nodes())?;
    let results: Vec<RankOutcome> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..cfg.ranks)
            .map(|rank| {
                let (tree, shards, ids, layout) = (&tree, &shards, &ids, &layout);
                scope.spawn(move || {
                    let out = rank_body(cfg, rank, rank, ids, layout, tree, shards);
                    if let Err(e) = &out {
                        crate::nccl::note_failure(format!("rank {rank} failed: {e}"));
                    }
                    out
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a rank thread panicked"))
            .collect()
    });
    let outputs = results
        .into_iter()
        .collect::<canopy_engine::Result<Vec<_>>>()?;
    let peak = outputs.iter().map(|o| o.peak_bytes).max().unwrap_or(0);
    let wire = outputs
        .iter()
        .map(|o| o.wire_bytes_per_step)
        .max()
        .unwrap_or(0);
    let rank0 = outputs.into_iter().next().expect("rank 0 reports");
    Ok(finish(cfg, &tree, &shards, rank0, peak, wire))
}

/// One process per GPU under mpirun/srun: this process is rank `comm.rank()` of `cfg.ranks`
/// (the MPI world size) and drives the GPU of its node-local rank; rank 0's NCCL ids reach
/// every rank over MPI, and nodes are the ranks' hosts (or `cfg.virtual_nodes`). Rank 0
/// returns the report.
#[cfg(feature = "mpi")]
pub fn run_mpi(
    cfg: &DistributedConfig,
    comm: &canopy_comm::MpiComm,
) -> canopy_engine::Result<Option<RunReport>> {
    use canopy_comm::{Collective, Group, ReduceOp};
    let local = comm.local_rank();
    check_machine(cfg, local + 1)?;
    connect_at_init();
    let (tree, shards) = problem(cfg)?;
    let layout = canopy_engine::strategy::node_layout(comm, cfg.virtual_nodes)?;
    let bytes = if comm.rank() == 0 {
        CommIds::new(layout.nodes())?.to_bytes()
    } else {
        vec![0u8; 128 * (layout.nodes() + 2)]
    };
    let mut all = vec![0u8; bytes.len() * comm.size()];
    comm.all_gather(&bytes, &mut all)?;
    let ids = CommIds::from_bytes(&all[..bytes.len()]);
    let out = rank_body(cfg, comm.rank(), local, &ids, &layout, &tree, &shards)?;
    let mut most = [out.peak_bytes as f32, out.wire_bytes_per_step as f32];
    comm.all_reduce(&mut most[..], ReduceOp::Max)?;
    comm.barrier()?;
    if comm.rank() != 0 {
        return Ok(None);
    }
    Ok(Some(finish(
        cfg,
        &tree,
        &shards,
        out,
        most[0] as u64,
        most[1] as u64,
    )))
}

/// Rank 0's timings and output, checked against the oracle, as a report.
fn finish(
    cfg: &DistributedConfig,
    tree: &KvTree,
    shards: &[Shard],
    rank0: RankOutput,
    peak_mem_bytes: u64,
    comm_bytes_per_rank: u64,
) -> RunReport {
    let (times, out, link) = rank0.rank0.expect("rank 0 reports its timings");
    let rel_error = cfg
        .check
        .then(|| relative_error(&out, &hashed_oracle(tree, &cfg.shape, cfg.dtype, cfg.seed)));
    let token_bytes = 2 * cfg.shape.kv_token_bytes(cfg.dtype) as u64;
    let kv_bytes_per_rank =
        shards.iter().map(|s| s.tokens() as u64).max().unwrap_or(0) * token_bytes;
    let measured = Measured {
        strategy: cfg.strategy,
        chosen: rank0.chosen,
        ranks: cfg.ranks,
        times_ms: times,
        kv_bytes_per_rank,
        comm_bytes_per_rank,
        peak_mem_bytes: Some(peak_mem_bytes),
        link_gbps: link.map(|bps| bps / 1e9),
        rel_error,
        rank_spread: None,
        output: None,
    };
    RunReport::new(measured, tree, &cfg.shape)
}

/// KV of `shard`, generated in place on this rank's GPU (windows back to back).
fn load_shard(
    backend: &CudaBackend,
    cfg: &DistributedConfig,
    shard: &Shard,
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
    tree: &KvTree,
    shard: &Shard,
) -> canopy_engine::Result<CudaPlan> {
    let method = cfg.tree.as_ref().map_or(Method::QGuided, |(_, m)| *m);
    let local = shard.localize(&plan(
        &TreeView::new(tree, shard),
        method,
        &cfg.shape,
        &PlannerConfig::whole_paths(),
    )?);
    backend.upload_plan(&cfg.shape, &local)
}

/// Wire bytes per timed step, from the counters before and after `time_ms_until`.
fn per_step(before: u64, after: u64, iters: usize) -> u64 {
    (after - before) / (WARMUP_STEPS + iters) as u64
}

/// One tree rank: load its shard, then time `cfg.iters` decode steps.
#[allow(clippy::too_many_arguments)]
fn rank_steps(
    backend: &CudaBackend,
    comms: &RankComms,
    watchdog: &Watchdog,
    cfg: &DistributedConfig,
    how: MergeCollective,
    layout: &NodeLayout,
    tree: &KvTree,
    shard: &Shard,
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
    let cells = tree.num_queries() * shape.q_heads;
    let mut merge = DeviceMerge::new(backend, cells, shape.head_dim, cfg.ranks)?;
    let (how, chosen) = match how {
        MergeCollective::Auto => {
            let model = merge.calibrate(backend, &comms.world, watchdog)?;
            let pick = model.choose(layout, cells as u64, shape.head_dim as u64);
            (pick, Some(pick))
        }
        how => (how, None),
    };
    let before = comms.wire_bytes();
    let times = backend.time_ms_until(
        cfg.iters,
        cfg.cache,
        |e| watchdog.wait(e, &comms.all()),
        || {
            backend.step(&kv, &q, &dplan, &mut partials, &mut out)?;
            merge.run(backend, comms, how, &mut out)
        },
    )?;
    let wire_bytes_per_step = per_step(before, comms.wire_bytes(), cfg.iters);
    let peak_bytes = backend.device_bytes_in_use()?;
    let rank0 = match comms.world.rank() {
        0 => Some((times, backend.download(&out)?.o, None)),
        _ => None,
    };
    Ok(RankOutput {
        rank0,
        peak_bytes,
        wire_bytes_per_step,
        chosen,
    })
}

/// Sends the first `tokens` tokens of `from` to `next` and receives `recv_tokens` tokens from
/// `prev` into `into`, as one NCCL group on the communicator's stream.
fn exchange(
    comm: &NcclComm,
    from: &CudaKv,
    tokens: usize,
    into: &mut CudaKv,
    recv_tokens: usize,
    next: usize,
    prev: usize,
) -> Result<()> {
    let (sb, rb) = (from.bytes_of(tokens), into.bytes_of(recv_tokens));
    group(comm.rank(), || {
        comm.send("send(K)", &from.k.slice(0..sb), next)?;
        comm.send("send(V)", &from.v.slice(0..sb), next)?;
        comm.recv("recv(K)", &mut into.k.slice_mut(0..rb), prev)?;
        comm.recv("recv(V)", &mut into.v.slice_mut(0..rb), prev)
    })
}

fn record(stream: &CudaStream) -> Result<cudarc::driver::CudaEvent> {
    stream.record_event(None).ctx("cuEventRecord")
}

/// One ring rank: time `cfg.iters` steps of p partial kernels, each on the shard that has just
/// arrived, while the next shard travels; then the NCCL exchange alone, for the link bandwidth.
fn ring_steps(
    backend: &CudaBackend,
    comm: &NcclComm,
    watchdog: &Watchdog,
    cfg: &DistributedConfig,
    tree: &KvTree,
    shards: &[Shard],
) -> RankOutcome {
    let shape = &cfg.shape;
    let (rank, p) = (comm.rank(), cfg.ranks);
    let (next, prev) = ((rank + 1) % p, (rank + p - 1) % p);
    let tokens: Vec<usize> = shards.iter().map(|s| s.tokens() as usize).collect();
    let max_tokens = tokens.iter().copied().max().unwrap_or(0);
    let own = load_shard(backend, cfg, &shards[rank], tokens[rank])?;
    // One rank receives nothing: token-sized placeholders instead of receive buffers.
    let room = if p > 1 { max_tokens } else { 1 };
    let mut bufs = [
        backend.alloc_kv(shape, cfg.dtype, room)?,
        backend.alloc_kv(shape, cfg.dtype, room)?,
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
    let (compute, transfer) = (backend.stream(), comm.stream());
    let before = comm.wire_bytes();
    let times = backend.time_ms_until(
        cfg.iters,
        cfg.cache,
        |e| watchdog.wait(e, &[comm]),
        || {
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
                    Some(record(transfer)?)
                } else {
                    None
                };
                let out = if s == 0 { &mut acc } else { &mut tmp };
                backend.step(cur, &q, &plans[src], &mut partials[src], out)?;
                if s > 0 {
                    backend.merge_into(&mut acc, &tmp)?;
                }
                ready = record(compute)?;
                if let Some(ev) = arrived {
                    compute.wait(&ev).ctx("cuStreamWaitEvent")?;
                }
            }
            Ok::<(), CudaError>(())
        },
    )?;
    let wire_bytes_per_step = per_step(before, comm.wire_bytes(), cfg.iters);
    let peak_bytes = backend.device_bytes_in_use()?;
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
        watchdog.wait(&end, &[comm])?;
        let ms = start.elapsed_ms(&end).ctx("cuEventElapsedTime")? as f64 / reps as f64;
        Some(2.0 * own.bytes_of(tokens[rank]) as f64 / (ms * 1e-3))
    } else {
        None
    };
    let rank0 = match rank {
        0 => Some((times, backend.download(&acc)?.o, link)),
        _ => None,
    };
    Ok(RankOutput {
        rank0,
        peak_bytes,
        wire_bytes_per_step,
        chosen: None,
    })
}
