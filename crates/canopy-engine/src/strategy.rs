//! Distributed decode over `p` ranks: **tree** (local partials, then a cross-rank merge) and
//! **ring** (KV blocks travel around the ring, each rank folding every block into its own
//! queries' states).
//!
//! [`rank_main`] is the attention benchmark's one rank loop, for every backend and transport:
//! it loads the rank's shard ([`RankData`]: host data written in, or generated where it lives),
//! plans, calibrates `auto` on the transport's own buffers ([`calibrate_on`]), builds the
//! [`RankAttention`] step and times it as the transport keeps time
//! ([`Transport::time_steps`]). Threads of one process ([`run_threads`]), MPI processes and
//! GPUs over NCCL (`canopy_cuda::distributed`) all run it; [`report`] describes what they
//! measured.

use crate::backend::{Backend, Cache};
use crate::cost::{CallKind, CostModel};
use crate::merge::{HostCollective, MergeCollective, MergeOps, Transport};
use crate::report::{Measured, RunReport};
use crate::step::{RankAttention, RingShard};
use crate::topology::NodeLayout;
use crate::CpuBackend;
use crate::{EngineError, Result};
use canopy_comm::{Collective, Group, HostPart, ReduceOp, ThreadWorld};
use canopy_core::{
    plan, reference_attention, relative_error, shard_tree, AttnShape, AttnStates, DType, KvTree,
    Method, Plan, PlannerConfig, ProblemData, Shard, SliceKv, TreeView, TypedVec,
};
use serde::Serialize;
use std::time::{Duration, Instant};

/// How ranks combine their shards.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub enum Strategy {
    Tree(MergeCollective),
    Ring,
}

impl Strategy {
    /// Every tree merge, then the ring.
    pub fn every() -> Vec<Strategy> {
        MergeCollective::ALL
            .into_iter()
            .map(Strategy::Tree)
            .chain([Strategy::Ring])
            .collect()
    }

    pub fn name(&self) -> String {
        match self {
            Strategy::Tree(c) => format!("tree/{}", c.name()),
            Strategy::Ring => "ring".into(),
        }
    }
}

/// An attention problem: a tree, its shape and dtype, and its data.
#[derive(Debug, Clone)]
pub struct Problem {
    pub tree: KvTree,
    pub shape: AttnShape,
    pub dtype: DType,
    pub data: ProblemData,
}

impl Problem {
    /// Fresh random data for `tree`.
    pub fn random(tree: KvTree, shape: AttnShape, dtype: DType, seed: u64) -> Problem {
        let data = ProblemData::random(
            &shape,
            dtype,
            tree.num_queries(),
            tree.total_tokens() as usize,
            seed,
        );
        Problem {
            tree,
            shape,
            dtype,
            data,
        }
    }

    /// The f64 oracle's outputs.
    pub fn oracle(&self) -> Vec<f64> {
        let (k, v) = (self.data.k.to_f32_vec(), self.data.v.to_f32_vec());
        let kv = SliceKv {
            k: &k,
            v: &v,
            kv_heads: self.shape.kv_heads,
        };
        reference_attention(&self.tree, &self.shape, &self.data.q, &kv).0
    }

    /// This shard's K and V, copied into compact storage (windows back to back).
    fn host_shard(&self, shard: &Shard) -> (TypedVec, TypedVec) {
        let per = self.shape.kv_token_elems();
        let mut k = TypedVec::zeros(self.dtype, shard.tokens() as usize * per);
        let mut v = k.clone();
        let mut at = 0;
        for w in &shard.windows {
            let (s, e) = (w.start as usize * per, w.end as usize * per);
            k.copy_from(at, &self.data.k.slice(s..e));
            v.copy_from(at, &self.data.v.slice(s..e));
            at += e - s;
        }
        (k, v)
    }
}

/// What a rank attends over: the tree, its shape and dtype, and where the queries and its
/// shard's KV come from. [`Problem`] writes host data into any backend; a device backend can
/// generate its shard in place instead (`canopy_cuda::distributed`, for contexts too large to
/// hold on the host).
pub trait RankData<B: Backend>: Sync {
    /// The tree, the attention shape and the KV dtype.
    fn problem(&self) -> (&KvTree, AttnShape, DType);
    /// The step's queries, uploaded.
    fn queries(&self, b: &B) -> Result<B::Queries>;
    /// `shard`'s K and V, windows back to back, in fresh storage of `shard.tokens()` tokens.
    fn shard_kv(&self, b: &B, shard: &Shard) -> Result<B::Kv>;
}

impl<B: Backend> RankData<B> for Problem {
    fn problem(&self) -> (&KvTree, AttnShape, DType) {
        (&self.tree, self.shape, self.dtype)
    }

    fn queries(&self, b: &B) -> Result<B::Queries> {
        b.upload_queries(&self.shape, &self.data.q)
    }

    fn shard_kv(&self, b: &B, shard: &Shard) -> Result<B::Kv> {
        let mut kv = b.alloc_kv(&self.shape, self.dtype, shard.tokens() as usize)?;
        let (k, v) = self.host_shard(shard);
        b.write_kv(&mut kv, 0, &k, &v)?;
        Ok(kv)
    }
}

/// Everything a distributed run needs besides the problem.
#[derive(Debug, Clone)]
pub struct RunConfig {
    pub ranks: usize,
    pub strategy: Strategy,
    pub method: Method,
    pub planner: PlannerConfig,
    /// Untimed steps before the timed ones (besides a device clock's own warm-up).
    pub warmup: usize,
    pub iters: usize,
    /// What each timed step finds in the device's caches (backends that time themselves).
    pub cache: Cache,
    pub timeout: Duration,
    /// Poison every output buffer before each step (tests), so unwritten rows show as NaN.
    pub poison: bool,
    /// Cut the world into this many equal virtual nodes for the hierarchical merge (testing the
    /// two-level path on one host); `None`: nodes are the ranks' hosts.
    pub virtual_nodes: Option<usize>,
    /// Fault injection (tests of timeouts and watchdogs): this rank fails once it is set up,
    /// before its first step, as if it had died.
    pub stall_rank: Option<usize>,
}

/// What one rank measured and produced.
#[derive(Debug, Clone)]
pub struct RankResult {
    /// Milliseconds of each timed decode step, as the transport keeps time.
    pub times_ms: Vec<f64>,
    pub output: AttnStates,
    pub kv_bytes: u64,
    /// Bytes this rank communicated per step.
    pub comm_bytes_per_step: u64,
    /// The merge `auto` chose, if the strategy was `tree/auto`.
    pub chosen: Option<MergeCollective>,
    /// Device memory in use while the step's buffers lived (backends that can tell).
    pub peak_mem_bytes: Option<u64>,
    /// Ring on GPUs: the hand-off's bandwidth measured alone, GB/s sent (set by the caller).
    pub link_gbps: Option<f64>,
}

/// Where this world's ranks live: `virtual_nodes` equal blocks if given, else grouped by the
/// ranks' host names (gathered over `comm`).
pub fn node_layout<C: Collective>(comm: &C, virtual_nodes: Option<usize>) -> Result<NodeLayout> {
    if let Some(k) = virtual_nodes {
        return NodeLayout::virtual_nodes(comm.size(), k);
    }
    const WIDTH: usize = 256;
    let mut mine = comm.host_name()?.into_bytes();
    mine.resize(WIDTH, 0);
    let mut all = vec![0u8; WIDTH * comm.size()];
    comm.all_gather(&mine, &mut all)?;
    let names: Vec<&[u8]> = all.chunks(WIDTH).collect();
    Ok(NodeLayout::from_host_names(
        &names
            .iter()
            .map(|n| String::from_utf8_lossy(n).into_owned())
            .collect::<Vec<_>>(),
    ))
}

/// Calibrates the merge cost model on `comm`'s host collectives, by timing them on host
/// buffers: [`calibrate_on`] the CPU backend's buffers.
pub fn calibrate<C: Collective>(comm: &C, cells: u64, d: u64) -> Result<CostModel> {
    calibrate_on(&CpuBackend, &HostCalls(comm), cells, d)
}

/// The host collectives of any [`Collective`], as a [`HostCollective`] (the transport of host
/// buffers) for [`calibrate`].
struct HostCalls<'a, C>(&'a C);

impl<C: Collective> Group for HostCalls<'_, C> {
    fn rank(&self) -> usize {
        self.0.rank()
    }

    fn size(&self) -> usize {
        self.0.size()
    }
}

impl<C: Collective> HostPart for HostCalls<'_, C> {
    type Host = C;
    fn host(&self) -> &C {
        self.0
    }
}

impl<C: Collective> HostCollective for HostCalls<'_, C> {}

/// Calibrates the merge cost model on `comm` by timing its all-reduce and all-gather of
/// `backend`'s buffers at the merge's two payload sizes (what the merge will send, where it
/// lives); every rank takes the slowest rank's timings, so all build the same model and make
/// the same choice.
pub fn calibrate_on<B: MergeOps, C: Transport<B>>(
    backend: &B,
    comm: &C,
    cells: u64,
    d: u64,
) -> Result<CostModel> {
    const REPS: u32 = 10;
    let p = comm.size();
    let mut slowest = backend.alloc_buf(1)?;
    CostModel::calibrate(p, cells, d, |kind, bytes| {
        let n = (bytes / 4) as usize;
        let mut buf = backend.alloc_buf(n)?;
        let mut gathered = backend.alloc_buf(n * p)?;
        let mut one = || match kind {
            CallKind::AllGather => comm.all_gather_buf(backend, &buf, n, &mut gathered),
            _ => comm.all_reduce_buf(backend, &mut buf, 0..n, ReduceOp::Sum),
        };
        // The warm-up call also lines the ranks up.
        one()?;
        comm.wait(backend)?;
        let t0 = Instant::now();
        for _ in 0..REPS {
            one()?;
        }
        comm.wait(backend)?;
        let us = (t0.elapsed().as_secs_f64() * 1e6 / REPS as f64) as f32;
        backend.buf_from_host(&[us], &mut slowest, 0)?;
        comm.all_reduce_buf(backend, &mut slowest, 0..1, ReduceOp::Max)?;
        comm.wait(backend)?;
        Ok::<f64, EngineError>(f64::from(backend.buf_to_host(&slowest, 0..1)?[0]))
    })
}

/// Plans `shard` and rewrites it to the rank's compact addresses.
fn local_plan(tree: &KvTree, shape: &AttnShape, shard: &Shard, cfg: &RunConfig) -> Result<Plan> {
    let view = TreeView::new(tree, shard);
    Ok(shard.localize(&plan(&view, cfg.method, shape, &cfg.planner)?))
}

/// One rank's whole run: load its shard, plan, warm up, then time `iters` decode steps.
pub fn rank_main<B, C, D>(data: &D, cfg: &RunConfig, backend: &B, comm: &C) -> Result<RankResult>
where
    B: MergeOps,
    C: Collective + Transport<B>,
    D: RankData<B> + ?Sized,
{
    let (rank, p) = (comm.rank(), comm.size());
    let (tree, shape, dtype) = data.problem();
    let shards = shard_tree(tree, p)?;
    let q = data.queries(backend)?;
    let own = data.shard_kv(backend, &shards[rank])?;

    let mut chosen = None;
    let mut attention = match cfg.strategy {
        Strategy::Tree(how) => {
            let layout = node_layout(comm, cfg.virtual_nodes)?;
            let how = match how {
                MergeCollective::Auto => {
                    let cells = (tree.num_queries() * shape.q_heads) as u64;
                    let d = shape.head_dim as u64;
                    let pick = calibrate_on(backend, comm, cells, d)?.choose(&layout, cells, d);
                    chosen = Some(pick);
                    pick
                }
                how => how,
            };
            let plan = local_plan(tree, &shape, &shards[rank], cfg)?;
            RankAttention::tree(backend, comm, shape, &plan, how, layout)?
        }
        Strategy::Ring => {
            let ring = shards
                .iter()
                .map(|s| {
                    Ok(RingShard {
                        plan: local_plan(tree, &shape, s, cfg)?,
                        tokens: s.tokens() as usize,
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            RankAttention::ring(backend, comm, shape, dtype, ring)?
        }
    }
    .with_poison(cfg.poison);
    if cfg.stall_rank == Some(rank) {
        return Err(EngineError::Config(format!(
            "rank {rank}: stopped before its first step (fault injected with --stall-rank)"
        )));
    }

    let traffic_before = comm.traffic().bytes;
    let mut runs = 0u64;
    let times_ms = comm.time_steps(
        backend,
        cfg.warmup,
        cfg.iters.max(1),
        cfg.cache,
        &mut || {
            runs += 1;
            attention.attend(&own, &q).map(drop)
        },
    )?;
    let comm_bytes_per_step = (comm.traffic().bytes - traffic_before) / runs.max(1);
    Ok(RankResult {
        times_ms,
        output: backend.download(attention.states())?,
        kv_bytes: shards[rank].tokens() as u64 * 2 * shape.kv_token_bytes(dtype) as u64,
        comm_bytes_per_step,
        chosen,
        peak_mem_bytes: backend.bytes_in_use()?,
        link_gbps: None,
    })
}

/// Runs `cfg.ranks` ranks as threads of this process, each with a backend from `make`.
pub fn run_threads<B, F>(
    problem: &Problem,
    cfg: &RunConfig,
    oracle: Option<&[f64]>,
    make: F,
) -> Result<RunReport>
where
    B: MergeOps,
    F: Fn(usize) -> Result<B> + Sync,
{
    if cfg.ranks == 0 {
        return Err(EngineError::Config("--ranks must be at least 1".into()));
    }
    let results = ThreadWorld::run(cfg.ranks, cfg.timeout, |comm| {
        let backend = make(comm.rank())?;
        rank_main(problem, cfg, &backend, &comm)
    });
    let results = results.into_iter().collect::<Result<Vec<_>>>()?;
    Ok(report(&problem.tree, &problem.shape, cfg, results, oracle))
}

/// Gathers the ranks' results (in rank order) into one report of a run over `tree`.
pub fn report(
    tree: &KvTree,
    shape: &AttnShape,
    cfg: &RunConfig,
    results: Vec<RankResult>,
    oracle: Option<&[f64]>,
) -> RunReport {
    let base: Vec<f64> = results[0].output.o.iter().map(|&x| x as f64).collect();
    let rank_spread = results
        .iter()
        .map(|r| relative_error(&r.output.o, &base))
        .fold(0.0, f64::max);
    let rel_error = oracle.map(|want| {
        results
            .iter()
            .map(|r| relative_error(&r.output.o, want))
            .fold(0.0, f64::max)
    });
    let measured = Measured {
        strategy: cfg.strategy,
        chosen: results[0].chosen,
        ranks: cfg.ranks,
        times_ms: results[0].times_ms.clone(),
        kv_bytes_per_rank: results.iter().map(|r| r.kv_bytes).max().unwrap_or(0),
        comm_bytes_per_rank: results
            .iter()
            .map(|r| r.comm_bytes_per_step)
            .max()
            .unwrap_or(0),
        peak_mem_bytes: results.iter().filter_map(|r| r.peak_mem_bytes).max(),
        link_gbps: results[0].link_gbps,
        rel_error,
        rank_spread: Some(rank_spread),
        output: results.into_iter().next().map(|r| r.output),
    };
    RunReport::new(measured, tree, shape)
}

/// Every rank's result at rank 0 (`None` elsewhere), for [`report`] when each rank is its own
/// process: the outputs and counts travel over `comm`; the timings and `auto`'s choice are
/// rank 0's, as in a report of threads.
pub fn gather_results<C: Collective>(
    comm: &C,
    mine: RankResult,
) -> Result<Option<Vec<RankResult>>> {
    let p = comm.size();
    let mut o = vec![0f32; mine.output.o.len() * p];
    comm.all_gather(&mine.output.o, &mut o)?;
    let mut lse = vec![0f32; mine.output.lse.len() * p];
    comm.all_gather(&mine.output.lse, &mut lse)?;
    // kv bytes, comm bytes per step, peak memory + 1 (0: not measured).
    const WORDS: usize = 3;
    let own: Vec<u8> = [
        mine.kv_bytes,
        mine.comm_bytes_per_step,
        mine.peak_mem_bytes.map_or(0, |b| b + 1),
    ]
    .iter()
    .flat_map(|w| w.to_le_bytes())
    .collect();
    let mut counts = vec![0u8; own.len() * p];
    comm.all_gather(&own, &mut counts)?;
    if comm.rank() != 0 {
        return Ok(None);
    }
    let (no, nl) = (mine.output.o.len(), mine.output.lse.len());
    let words: Vec<u64> = counts
        .chunks(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect();
    Ok(Some(
        (0..p)
            .map(|r| {
                let w = &words[r * WORDS..(r + 1) * WORDS];
                let mut output = mine.output.clone();
                output.o.copy_from_slice(&o[r * no..(r + 1) * no]);
                output.lse.copy_from_slice(&lse[r * nl..(r + 1) * nl]);
                RankResult {
                    output,
                    kv_bytes: w[0],
                    comm_bytes_per_step: w[1],
                    peak_mem_bytes: w[2].checked_sub(1),
                    ..mine.clone()
                }
            })
            .collect(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CpuBackend;
    use canopy_core::random_tree;

    /// Rank 0 gets every rank's output and counts, in rank order, and the others nothing.
    #[test]
    fn gathered_results_are_every_ranks_in_rank_order() {
        let shape = AttnShape::new(2, 1, 64).unwrap();
        let problem = Problem::random(random_tree(5, 4, 20), shape, DType::F32, 5);
        let ranks = 3;
        let cfg = RunConfig {
            ranks,
            strategy: Strategy::Tree(MergeCollective::Allgather),
            method: Method::QGuided,
            planner: PlannerConfig::default(),
            warmup: 0,
            iters: 1,
            cache: Cache::Warm,
            timeout: Duration::from_secs(60),
            poison: false,
            virtual_nodes: None,
            stall_rank: None,
        };
        let out = ThreadWorld::run(ranks, cfg.timeout, |comm| {
            let mut mine = rank_main(&problem, &cfg, &CpuBackend, &comm)?;
            mine.kv_bytes = 100 + comm.rank() as u64;
            mine.peak_mem_bytes = (comm.rank() == 1).then_some(7);
            // Each rank's output marked, to see where it lands.
            mine.output.o[0] = comm.rank() as f32;
            gather_results(&comm, mine)
        });
        let mut out = out.into_iter().map(|r| r.expect("the rank ran"));
        let all = out.next().unwrap().expect("rank 0 gets the results");
        assert!(out.all(|r| r.is_none()));
        assert_eq!(all.len(), ranks);
        for (r, res) in all.iter().enumerate() {
            assert_eq!(res.output.o[0], r as f32);
            assert_eq!(res.kv_bytes, 100 + r as u64);
            assert_eq!(res.peak_mem_bytes, (r == 1).then_some(7));
        }
    }
}
