//! `canopy bench tree`: tree-structured KV (shared prefixes) with every planning method.
//!
//! One rank: each method planned, run on the backend, checked against the f64 oracle and timed
//! (CUDA events on a GPU); speedups over Q-guided, the plan's analytic KV/Q/partial bytes, and
//! the tree's KV-read floor (each token of the tree once, at the measured copy bandwidth).
//! More ranks: the flattened tree split evenly over them, each rank planning its part, merged
//! across ranks (NCCL on CUDA, the engine's collectives on the CPU).

use crate::bench::{resolve_backend, BackendChoice};
use crate::plan_cmd::{ShapeArgs, SizeArgs};
use crate::table::{bytes, Table};
use anyhow::{bail, Result};
use canopy_core::data::{hashed_queries, HashedKv};
use canopy_core::{
    reference_attention, AttnShape, DType, KvTree, Method, PlannerConfig, Shard, TreeView,
    WorkloadSpec,
};
use canopy_cuda::{CudaBackend, KernelChoice};
use canopy_engine::tree_bench::{relate_to_q_guided, MethodRun, TreeBench};
use canopy_engine::{Backend, CpuBackend, MergeCollective, Problem, RunConfig, Strategy};
use clap::Args;
use serde::Serialize;
use std::time::Duration;

#[derive(Args)]
pub struct TreeArgs {
    /// A built-in workload (fasttree-0 … fasttree-9, few-shot-b20/-b30/-b50, tot-*, spec-t32 …
    /// spec-t256) or a TOML file.
    #[arg(long)]
    workload: String,
    /// q-guided, deft-node, deft-node-chunk, deft-flatten, fasttree, auto, a comma list, or all.
    #[arg(long, default_value = "all")]
    method: String,
    #[command(flatten)]
    shape: ShapeArgs,
    #[command(flatten)]
    sizes: SizeArgs,
    /// Ranks the flattened tree is split over (one GPU each on CUDA).
    #[arg(long, default_value_t = 1)]
    ranks: usize,
    /// Timed runs per method (after three warm-ups); the median is reported.
    #[arg(long, default_value_t = 20)]
    iterations: usize,
    #[arg(long, value_enum, default_value = "auto")]
    backend: BackendChoice,
    /// CUDA stage-1 kernel: auto (tensor cores for groups with several query rows), simt, mma.
    #[arg(long, default_value = "auto")]
    kernel: KernelChoice,
    /// CUDA: waves of resident CTAs a step is cut into (the tensor-core kernel runs a bin of
    /// consecutive groups per CTA; more waves, fewer groups per bin).
    #[arg(long, default_value_t = 1)]
    waves: u32,
    /// CUDA: KV tokens per shared-memory tile of the tensor-core kernel (64 or 32).
    #[arg(long, default_value_t = 64)]
    mma_tile: usize,
    /// Check every method against the f64 oracle.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    check: bool,
    #[arg(long, default_value_t = 7)]
    seed: u64,
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct TreeOutput {
    workload: String,
    backend: &'static str,
    device: String,
    kernel: KernelChoice,
    ranks: usize,
    nodes: usize,
    tree_tokens: u32,
    queries: usize,
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    dtype: DType,
    /// Device-to-device copy bandwidth (bytes read + written per second), CUDA only.
    copy_gbps: Option<f64>,
    /// The tree's K and V read once at the copy bandwidth, in microseconds.
    kv_floor_us: Option<f64>,
    methods: Vec<MethodRun>,
}

pub fn run(a: TreeArgs) -> Result<()> {
    if a.ranks == 0 {
        bail!("--ranks must be at least 1");
    }
    let mut spec = WorkloadSpec::load(&a.workload)?.with_overrides(a.sizes.overrides())?;
    a.shape.apply(&mut spec)?;
    let methods = Method::parse_list(&a.method)?;
    let tree = spec.build_tree()?;
    let backend = resolve_backend(a.backend)?;
    let planner = PlannerConfig {
        // The backends split long groups to fill the device; Q-guided keeps each path whole.
        q_guided_chunk: u32::MAX,
        ..PlannerConfig::default()
    };
    let (device, copy, runs) = match (backend, a.ranks) {
        ("cuda", 1) => cuda_one(&a, &spec, &tree, &methods, planner)?,
        ("cuda", p) => ("cuda".into(), None, cuda_ranks(&a, &spec, p, &methods)?),
        (_, 1) => (
            "cpu".into(),
            None,
            cpu_one(&a, &spec, &tree, &methods, planner)?,
        ),
        (_, p) => (
            "cpu".into(),
            None,
            cpu_ranks(&a, &spec, &tree, p, &methods, planner)?,
        ),
    };
    let kv_bytes = tree.total_tokens() as u64 * 2 * spec.shape.kv_token_bytes(spec.dtype) as u64;
    let out = TreeOutput {
        workload: spec.name.clone(),
        backend,
        device,
        kernel: a.kernel,
        ranks: a.ranks,
        nodes: tree.nodes().len(),
        tree_tokens: tree.total_tokens(),
        queries: tree.num_queries(),
        q_heads: spec.shape.q_heads,
        kv_heads: spec.shape.kv_heads,
        head_dim: spec.shape.head_dim,
        dtype: spec.dtype,
        copy_gbps: copy.map(|c| c / 1e9),
        kv_floor_us: copy.map(|c| kv_bytes as f64 / c * 1e6),
        methods: runs,
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!(
        "{} on {} ({} rank{}): {} nodes, {} tokens, {} queries; {}/{} heads x {}, {}{}",
        out.workload,
        out.device,
        out.ranks,
        if out.ranks == 1 { "" } else { "s" },
        out.nodes,
        out.tree_tokens,
        out.queries,
        out.q_heads,
        out.kv_heads,
        out.head_dim,
        out.dtype,
        match (out.copy_gbps, out.kv_floor_us) {
            (Some(c), Some(f)) => format!("; copy {c:.0} GB/s, KV floor {f:.1} us"),
            _ => String::new(),
        }
    );
    println!("{}", method_table(&out.methods).render());
    Ok(())
}

fn method_table(runs: &[MethodRun]) -> Table {
    let mut t = Table::new(&[
        "method",
        "groups",
        "partials",
        "KV read",
        "KV vs q-g",
        "Q read",
        "partials r+w",
        "plan ms",
        "median us",
        "p10 us",
        "p90 us",
        "stage 1 us",
        "speedup",
        "rel err",
    ]);
    for r in runs {
        t.row(vec![
            match (r.chosen, r.predicted_us) {
                (Some(m), Some(p)) => format!("{} ({m}, {p:.0} us pred.)", r.method),
                _ => r.method.to_string(),
            },
            r.io.groups.to_string(),
            r.io.partial_rows.to_string(),
            bytes(r.io.kv_bytes),
            r.kv_vs_q_guided.map_or("-".into(), |x| format!("{x:.3}")),
            bytes(r.io.q_bytes),
            bytes(r.io.partial_bytes),
            format!("{:.2}", r.plan_ms),
            format!("{:.1}", r.median_us),
            format!("{:.1}", r.p10_us),
            format!("{:.1}", r.p90_us),
            format!("{:.1}", r.stage1_us),
            r.speedup_vs_q_guided
                .map_or("-".into(), |x| format!("{x:.2}x")),
            r.rel_error.map_or("-".into(), |e| format!("{e:.2e}")),
        ]);
    }
    t
}

/// The f64 oracle over hashed data (the same values every backend generates).
fn oracle(tree: &KvTree, shape: &AttnShape, dtype: DType, seed: u64) -> Vec<f64> {
    let q = hashed_queries(shape, dtype, tree.num_queries(), seed);
    let kv = HashedKv {
        seed,
        dtype,
        kv_heads: shape.kv_heads,
    };
    reference_attention(tree, shape, &q, &kv).0
}

fn cuda_one(
    a: &TreeArgs,
    spec: &WorkloadSpec,
    tree: &KvTree,
    methods: &[Method],
    planner: PlannerConfig,
) -> Result<(String, Option<f64>, Vec<MethodRun>)> {
    let backend = CudaBackend::new(0)?
        .with_kernel(a.kernel)
        .with_waves(a.waves)
        .with_mma_tile(a.mma_tile)?;
    let copy = canopy_cuda::bench::measure_copy_bandwidth(&backend)?;
    let (shape, dtype) = (spec.shape, spec.dtype);
    let tokens = tree.total_tokens() as usize;
    let mut kv = backend.alloc_kv(&shape, dtype, tokens)?;
    backend.fill_random(&mut kv, 0, tokens, a.seed, 0)?;
    let q = backend.upload_queries(
        &shape,
        &hashed_queries(&shape, dtype, tree.num_queries(), a.seed),
    )?;
    let want = a.check.then(|| oracle(tree, &shape, dtype, a.seed));
    let shard = Shard::whole(tree);
    let view = TreeView::new(tree, &shard);
    let bench = TreeBench {
        view: &view,
        shape,
        dtype,
        planner,
        iters: a.iterations,
    };
    let runs = bench.run(&backend, &kv, &q, methods, want.as_deref())?;
    Ok((backend.gpu().name.clone(), Some(copy), runs))
}

fn cpu_one(
    a: &TreeArgs,
    spec: &WorkloadSpec,
    tree: &KvTree,
    methods: &[Method],
    planner: PlannerConfig,
) -> Result<Vec<MethodRun>> {
    let problem = Problem::random(tree.clone(), spec.shape, spec.dtype, a.seed);
    let backend = CpuBackend;
    let mut kv = backend.alloc_kv(&spec.shape, spec.dtype, tree.total_tokens() as usize)?;
    backend.write_kv(&mut kv, 0, &problem.data.k, &problem.data.v)?;
    let q = backend.upload_queries(&spec.shape, &problem.data.q)?;
    let want = a.check.then(|| problem.oracle());
    let shard = Shard::whole(tree);
    let view = TreeView::new(tree, &shard);
    let bench = TreeBench {
        view: &view,
        shape: spec.shape,
        dtype: spec.dtype,
        planner,
        iters: a.iterations,
    };
    Ok(bench.run(&backend, &kv, &q, methods, want.as_deref())?)
}

/// A distributed run's result as a method row (its IO is rank 0's plan's).
fn distributed_row(
    method: Method,
    median_us: f64,
    p10_us: f64,
    p90_us: f64,
    rel_error: Option<f64>,
    io: canopy_core::IoReport,
) -> MethodRun {
    MethodRun {
        method,
        chosen: None,
        predicted_us: None,
        plan_ms: 0.0,
        io,
        median_us,
        p10_us,
        p90_us,
        stage1_us: f64::NAN,
        speedup_vs_q_guided: None,
        kv_vs_q_guided: None,
        rel_error,
    }
}

/// Rank 0's plan IO for `method` (what one rank reads).
fn rank0_io(
    tree: &KvTree,
    spec: &WorkloadSpec,
    ranks: usize,
    method: Method,
    planner: &PlannerConfig,
) -> Result<canopy_core::IoReport> {
    let shards = canopy_core::shard_tree(tree, ranks)?;
    let view = TreeView::new(tree, &shards[0]);
    Ok(canopy_core::plan(&view, method, &spec.shape, planner)?.io(&spec.shape, spec.dtype))
}

fn cpu_ranks(
    a: &TreeArgs,
    spec: &WorkloadSpec,
    tree: &KvTree,
    ranks: usize,
    methods: &[Method],
    planner: PlannerConfig,
) -> Result<Vec<MethodRun>> {
    let problem = Problem::random(tree.clone(), spec.shape, spec.dtype, a.seed);
    let want = a.check.then(|| problem.oracle());
    let mut runs = Vec::new();
    for &method in methods {
        let cfg = RunConfig {
            ranks,
            strategy: Strategy::Tree(MergeCollective::Allreduce2),
            method,
            planner,
            warmup: 1,
            iters: a.iterations,
            timeout: Duration::from_secs(120),
            poison: true,
            virtual_nodes: None,
        };
        let report =
            canopy_engine::run_threads(&problem, &cfg, want.as_deref(), |_| Ok(CpuBackend))?;
        let us: Vec<f64> = report.latencies_s.iter().map(|s| s * 1e6).collect();
        runs.push(distributed_row(
            method,
            canopy_core::stats::median(&us),
            canopy_core::stats::quantile(&us, 0.1),
            canopy_core::stats::quantile(&us, 0.9),
            report.rel_error,
            rank0_io(tree, spec, ranks, method, &planner)?,
        ));
    }
    relate_to_q_guided(&mut runs);
    Ok(runs)
}

fn cuda_ranks(
    a: &TreeArgs,
    spec: &WorkloadSpec,
    ranks: usize,
    methods: &[Method],
) -> Result<Vec<MethodRun>> {
    let tree = spec.build_tree()?;
    let mut runs = Vec::new();
    for &method in methods {
        let cfg = canopy_cuda::distributed::DistributedConfig {
            ranks,
            strategy: Strategy::Tree(MergeCollective::Auto),
            shape: spec.shape,
            dtype: spec.dtype,
            seq_len: 0,
            batch: 0,
            tree: Some((spec.tree.clone(), method)),
            kernel: a.kernel,
            iters: a.iterations,
            check: a.check,
            seed: a.seed,
            virtual_nodes: None,
            timeout: Duration::from_secs(120),
            stall_rank: None,
        };
        let r = canopy_cuda::distributed::run(&cfg)?;
        let planner = canopy_cuda::distributed::tree_planner();
        runs.push(distributed_row(
            method,
            r.median_ms * 1e3,
            r.p10_ms * 1e3,
            r.p90_ms * 1e3,
            r.rel_error,
            rank0_io(&tree, spec, ranks, method, &planner)?,
        ));
    }
    relate_to_q_guided(&mut runs);
    Ok(runs)
}
