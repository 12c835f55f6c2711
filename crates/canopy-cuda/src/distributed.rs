//! The attention benchmark across GPUs: the engine's rank loop
//! ([`canopy_engine::rank_main`]) on one [`CudaBackend`] per GPU over the NCCL transport
//! ([`NcclTransport`]), as threads of this process ([`run`], the zero-setup default) or as MPI
//! processes (`run_mpi`).
//!
//! The engine does the work: each rank's shard, plan and step ([`canopy_engine::RankAttention`],
//! tree or ring), `auto`'s calibration, the timing and the report. What is CUDA's here:
//! - the data: each rank generates its shard of the hashed problem in place on its GPU
//!   ([`HashedProblem`]), so a context of many gigabytes never passes through the host, and
//!   the f64 oracle regenerates it on the CPU for `--check`;
//! - the machine checks before anything is allocated (GPUs and NCCL present, the shard's
//!   buffers within the GPU's free memory);
//! - the NCCL ids every rank joins, and (ring) the hand-off's bandwidth measured alone.
//!
//! Timings are CUDA events on each rank's compute stream around whole steps, every step
//! enqueued before any is waited on; rank 0's are reported. Every wait goes through the rank's
//! watchdog: a dead or stalled peer ends each rank within the timeout with an error naming the
//! rank and the NCCL call, never a hang.

use crate::error::{CudaError, Result};
use crate::nccl::{connect_at_init, noting_failure};
use crate::nccl_transport::{NcclIds, NcclTransport};
use crate::{CudaBackend, CudaKv, CudaQueries, KernelSettings};
use canopy_comm::{Collective, Group, ThreadWorld};
use canopy_core::data::{hashed_oracle, hashed_queries};
use canopy_core::{shard_tree, AttnShape, DType, KvTree, Shard};
use canopy_engine::strategy::{report, RankData};
use canopy_engine::{rank_main, Backend, NodeLayout, RankResult, RunConfig, RunReport, Strategy};

/// What to run: the engine's run over a hashed problem, and the stage-1 kernel.
#[derive(Debug, Clone)]
pub struct DistributedConfig {
    /// Ranks (one GPU each), strategy, planner, steps, cache state, timeout, virtual nodes
    /// and the stall hook: the engine's configuration of any distributed run.
    pub run: RunConfig,
    pub problem: HashedProblem,
    /// The attention kernels' settings on every rank.
    pub kernels: KernelSettings,
    /// Checks every rank's output against the f64 oracle, regenerated on the CPU.
    pub check: bool,
}

/// A problem whose queries and KV are the counter hash of [`canopy_core::data`] under
/// `seed`: each rank generates its shard where it runs, and the oracle regenerates rows.
#[derive(Debug, Clone)]
pub struct HashedProblem {
    pub tree: KvTree,
    pub shape: AttnShape,
    pub dtype: DType,
    pub seed: u64,
}

impl RankData<CudaBackend> for HashedProblem {
    fn problem(&self) -> (&KvTree, AttnShape, DType) {
        (&self.tree, self.shape, self.dtype)
    }

    fn queries(&self, b: &CudaBackend) -> canopy_engine::Result<CudaQueries> {
        let q = hashed_queries(&self.shape, self.dtype, self.tree.num_queries(), self.seed);
        b.upload_queries(&self.shape, &q)
    }

    /// Generated in place on the GPU, window after window.
    fn shard_kv(&self, b: &CudaBackend, shard: &Shard) -> canopy_engine::Result<CudaKv> {
        let mut kv = b.alloc_kv(&self.shape, self.dtype, shard.tokens() as usize)?;
        let mut at = 0usize;
        for w in &shard.windows {
            let n = (w.end - w.start) as usize;
            b.fill_random(&mut kv, at, n, self.seed, w.start as u64)?;
            at += n;
        }
        Ok(kv)
    }
}

/// Refuses configurations this machine cannot run, before anything is allocated.
fn check_machine(ranks: usize, gpus_needed: usize) -> canopy_engine::Result<()> {
    let gpus = crate::probe::device_count()?;
    if ranks == 0 || gpus_needed > gpus {
        return Err(CudaError::Unsupported(format!(
            "{ranks} ranks need {gpus_needed} GPUs on this node but {gpus} are visible; lower the rank count"
        ))
        .into());
    }
    if !crate::probe::nccl_present() && ranks > 1 {
        return Err(CudaError::Unsupported(
            "NCCL (libnccl.so.2) could not be loaded; install NCCL or use one rank".into(),
        )
        .into());
    }
    Ok(())
}

/// The K and V bytes of the largest shard.
fn shard_bytes(cfg: &DistributedConfig, shards: &[Shard]) -> u64 {
    let p = &cfg.problem;
    let token_bytes = 2 * p.shape.kv_token_bytes(p.dtype) as u64;
    shards.iter().map(|s| s.tokens() as u64).max().unwrap_or(0) * token_bytes
}

/// Refuses shards whose KV buffers (the shard; the ring also two receive buffers) do not fit
/// in this GPU's free memory, before anything is allocated.
fn check_fits(backend: &CudaBackend, cfg: &DistributedConfig, shards: &[Shard]) -> Result<()> {
    let buffers = match cfg.run.strategy {
        Strategy::Ring if cfg.run.ranks > 1 => 3,
        _ => 1,
    };
    let need = shard_bytes(cfg, shards) * buffers;
    let free = backend.free_bytes()?;
    if need > free {
        return Err(CudaError::Unsupported(format!(
            "{} needs {:.1} GiB of KV buffers per rank but GPU {} has {:.1} GiB free; use more ranks or a shorter context",
            cfg.run.strategy.name(),
            need as f64 / (1u64 << 30) as f64,
            backend.gpu().ordinal,
            free as f64 / (1u64 << 30) as f64
        )));
    }
    Ok(())
}

/// One rank on GPU `gpu`, started with `host`: joins the NCCL communicators, runs the
/// engine's rank loop, and (ring) measures the hand-off alone.
fn rank<H: Collective>(
    cfg: &DistributedConfig,
    host: &H,
    gpu: usize,
    ids: &NcclIds,
    layout: &NodeLayout,
) -> canopy_engine::Result<RankResult> {
    let me = host.rank();
    let run = || -> canopy_engine::Result<RankResult> {
        let backend = CudaBackend::new(gpu)?.with_settings(cfg.kernels)?;
        let shards = shard_tree(&cfg.problem.tree, cfg.run.ranks)?;
        check_fits(&backend, cfg, &shards)?;
        let comm = NcclTransport::new(
            host,
            &backend,
            ids,
            layout.clone(),
            cfg.run.strategy,
            cfg.run.timeout,
        )?;
        let mut mine = rank_main(&cfg.problem, &cfg.run, &backend, &comm)?;
        if cfg.run.strategy == Strategy::Ring && cfg.run.ranks > 1 {
            mine.link_gbps = Some(link_gbps(&backend, &comm, cfg, &shards)? / 1e9);
        }
        Ok(mine)
    };
    noting_failure(me, run())
}

/// The ring's hand-off alone, this rank's shard to the next and the previous rank's in, on
/// buffers of the ring's sizes: bytes sent per second.
fn link_gbps<H: Collective>(
    backend: &CudaBackend,
    comm: &NcclTransport<'_, H>,
    cfg: &DistributedConfig,
    shards: &[Shard],
) -> canopy_engine::Result<f64> {
    let (me, p) = (comm.rank(), shards.len());
    let prev = (me + p - 1) % p;
    let tokens = |r: usize| shards[r].tokens() as usize;
    let (shape, dtype) = (&cfg.problem.shape, cfg.problem.dtype);
    let send = backend.alloc_kv(shape, dtype, tokens(me))?;
    let mut recv = backend.alloc_kv(shape, dtype, tokens(prev))?;
    comm.link_bandwidth(
        backend,
        &send,
        tokens(me),
        &mut recv,
        tokens(prev),
        cfg.run.iters,
    )
}

/// The node layout of a single-process run: one host, or the requested virtual nodes.
fn local_layout(run: &RunConfig) -> canopy_engine::Result<NodeLayout> {
    match run.virtual_nodes {
        Some(k) => NodeLayout::virtual_nodes(run.ranks, k),
        None => Ok(NodeLayout::single(run.ranks)),
    }
}

/// Runs `cfg` on GPUs `0..cfg.run.ranks`, one thread each, and reports.
pub fn run(cfg: &DistributedConfig) -> canopy_engine::Result<RunReport> {
    let ranks = cfg.run.ranks;
    check_machine(ranks, ranks)?;
    connect_at_init();
    let layout = local_layout(&cfg.run)?;
    let ids = NcclIds::new(layout.nodes())?;
    let results = ThreadWorld::run(ranks, cfg.run.timeout, |host| {
        rank(cfg, &host, host.rank(), &ids, &layout)
    })
    .into_iter()
    .collect::<canopy_engine::Result<Vec<_>>>()?;
    Ok(finish(cfg, results))
}

/// One process per GPU under mpirun/srun: this process is rank `comm.rank()` of
/// `cfg.run.ranks` (the MPI world size) and drives the GPU of its node-local rank; rank 0's
/// NCCL ids reach every rank over MPI, and nodes are the ranks' hosts (or the virtual nodes).
/// Rank 0 returns the report.
#[cfg(feature = "mpi")]
pub fn run_mpi(
    cfg: &DistributedConfig,
    comm: &canopy_comm::MpiComm,
) -> canopy_engine::Result<Option<RunReport>> {
    let local = comm.local_rank();
    check_machine(comm.size(), local + 1)?;
    connect_at_init();
    let layout = canopy_engine::strategy::node_layout(comm, cfg.run.virtual_nodes)?;
    let ids = NcclIds::from_rank0(comm, layout.nodes())?;
    let mine = rank(cfg, comm, local, &ids, &layout)?;
    let results = canopy_engine::strategy::gather_results(comm, mine)?;
    Ok(results.map(|r| finish(cfg, r)))
}

/// The ranks' results, checked against the oracle where asked, as a report.
fn finish(cfg: &DistributedConfig, results: Vec<RankResult>) -> RunReport {
    let p = &cfg.problem;
    let oracle = cfg
        .check
        .then(|| hashed_oracle(&p.tree, &p.shape, p.dtype, p.seed));
    report(&p.tree, &p.shape, &cfg.run, results, oracle.as_deref())
}
