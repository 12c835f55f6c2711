//! Distributed decode over `p` ranks: **tree** (local partials, then a cross-rank merge) and
//! **ring** (KV blocks travel around the ring, each rank folding every block into its own
//! queries' states). The per-rank logic ([`rank_main`]) is written against [`Collective`], so
//! the same code runs on threads of one process and, later, under `mpirun`.

use crate::cost::{CallKind, CostModel};
use crate::merge::{MergeCollective, MergeOps, Transport};
use crate::report::{Measured, RunReport};
use crate::step::{RankAttention, RingShard};
use crate::topology::NodeLayout;
use crate::{EngineError, Result};
use canopy_comm::{Collective, Group, ReduceOp, ThreadWorld};
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

    /// K and V bytes of one token.
    pub fn kv_token_bytes(&self) -> u64 {
        2 * self.shape.kv_token_bytes(self.dtype) as u64
    }

    /// This shard's K and V, copied into compact storage (windows back to back).
    fn shard_kv(&self, shard: &Shard) -> (TypedVec, TypedVec) {
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

/// Everything a distributed run needs besides the problem.
#[derive(Debug, Clone)]
pub struct RunConfig {
    pub ranks: usize,
    pub strategy: Strategy,
    pub method: Method,
    pub planner: PlannerConfig,
    pub warmup: usize,
    pub iters: usize,
    pub timeout: Duration,
    /// Poison every output buffer before each step (tests), so unwritten rows show as NaN.
    pub poison: bool,
    /// Cut the world into this many equal virtual nodes for the hierarchical merge (testing the
    /// two-level path on one host); `None`: nodes are the ranks' hosts.
    pub virtual_nodes: Option<usize>,
}

/// What one rank measured and produced.
#[derive(Debug, Clone)]
pub struct RankResult {
    /// Seconds per decode step (barrier to barrier).
    pub latencies: Vec<f64>,
    pub output: AttnStates,
    pub kv_bytes: u64,
    /// Bytes this rank communicated per step.
    pub comm_bytes_per_step: u64,
    /// The merge `auto` chose, if the strategy was `tree/auto`.
    pub chosen: Option<MergeCollective>,
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

/// Calibrates the merge cost model on `comm` by timing its collectives on host buffers; every
/// rank takes the slowest rank's timings, so all build the same model and make the same choice.
pub fn calibrate<C: Collective>(comm: &C, cells: u64, d: u64) -> Result<CostModel> {
    const REPS: u32 = 5;
    CostModel::calibrate(comm.size(), cells, d, |kind, bytes| {
        let n = (bytes / 4) as usize;
        let mut buf = vec![1.0f32; n];
        let mut gathered = vec![0.0f32; n * comm.size()];
        comm.barrier()?;
        let t0 = Instant::now();
        for _ in 0..REPS {
            match kind {
                CallKind::AllGather => comm.all_gather(&buf, &mut gathered)?,
                _ => comm.all_reduce(&mut buf, ReduceOp::Sum)?,
            }
        }
        let mut us = [(t0.elapsed().as_secs_f64() * 1e6 / REPS as f64) as f32];
        comm.all_reduce(&mut us[..], ReduceOp::Max)?;
        Ok::<f64, EngineError>(f64::from(us[0]))
    })
}

/// Plans `shard` and rewrites it to the rank's compact addresses.
fn local_plan(problem: &Problem, shard: &Shard, cfg: &RunConfig) -> Result<Plan> {
    let view = TreeView::new(&problem.tree, shard);
    Ok(shard.localize(&plan(&view, cfg.method, &problem.shape, &cfg.planner)?))
}

/// One rank's whole run: load its shard, plan, warm up, then time `iters` decode steps.
pub fn rank_main<B, C>(
    problem: &Problem,
    cfg: &RunConfig,
    backend: &B,
    comm: &C,
) -> Result<RankResult>
where
    B: MergeOps,
    C: Collective + Transport<B>,
{
    let (rank, p) = (comm.rank(), comm.size());
    let shards = shard_tree(&problem.tree, p)?;
    let shape = &problem.shape;
    let q = backend.upload_queries(shape, &problem.data.q)?;
    let mut own = backend.alloc_kv(shape, problem.dtype, shards[rank].tokens() as usize)?;
    let (k, v) = problem.shard_kv(&shards[rank]);
    backend.write_kv(&mut own, 0, &k, &v)?;
    drop((k, v));

    let nq = problem.tree.num_queries();
    let mut chosen = None;
    let mut attention = match cfg.strategy {
        Strategy::Tree(how) => {
            let layout = node_layout(comm, cfg.virtual_nodes)?;
            let how = match how {
                MergeCollective::Auto => {
                    let (cells, d) = ((nq * shape.q_heads) as u64, shape.head_dim as u64);
                    let pick = calibrate(comm, cells, d)?.choose(&layout, cells, d);
                    chosen = Some(pick);
                    pick
                }
                how => how,
            };
            let plan = local_plan(problem, &shards[rank], cfg)?;
            RankAttention::tree(backend, comm, *shape, &plan, how, layout)?
        }
        Strategy::Ring => {
            let ring = shards
                .iter()
                .map(|s| {
                    Ok(RingShard {
                        plan: local_plan(problem, s, cfg)?,
                        tokens: s.tokens() as usize,
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            RankAttention::ring(backend, comm, *shape, problem.dtype, ring)?
        }
    }
    .with_poison(cfg.poison);

    for _ in 0..cfg.warmup {
        attention.attend(&own, &q)?;
    }
    let traffic_before = comm.traffic().bytes;
    let mut latencies = Vec::with_capacity(cfg.iters);
    let mut output = None;
    for _ in 0..cfg.iters.max(1) {
        comm.barrier()?;
        let t0 = Instant::now();
        let out = backend.download(attention.attend(&own, &q)?)?;
        comm.barrier()?;
        latencies.push(t0.elapsed().as_secs_f64());
        output = Some(out);
    }
    let barrier_free = comm.traffic().bytes - traffic_before;
    Ok(RankResult {
        latencies,
        output: output.expect("at least one iteration"),
        kv_bytes: shards[rank].tokens() as u64 * problem.kv_token_bytes(),
        comm_bytes_per_step: barrier_free / cfg.iters.max(1) as u64,
        chosen,
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
    Ok(report(problem, cfg, results, oracle))
}

/// Gathers the ranks' results into one report of a run over `problem`.
pub fn report(
    problem: &Problem,
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
        times_ms: results[0].latencies.iter().map(|s| s * 1e3).collect(),
        kv_bytes_per_rank: results.iter().map(|r| r.kv_bytes).max().unwrap_or(0),
        comm_bytes_per_rank: results
            .iter()
            .map(|r| r.comm_bytes_per_step)
            .max()
            .unwrap_or(0),
        peak_mem_bytes: None,
        link_gbps: None,
        rel_error,
        rank_spread: Some(rank_spread),
        output: results.into_iter().next().map(|r| r.output),
    };
    RunReport::new(measured, &problem.tree, &problem.shape)
}
