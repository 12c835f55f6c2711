//! `canopy bench attention` and `canopy selftest`.

use crate::plan_cmd::ShapeArgs;
use crate::table::{bytes, quantile, Table};
use anyhow::{bail, Result};
use canopy_core::{Method, Overrides, PlannerConfig, WorkloadSpec};
use canopy_engine::conformance::run_suite;
use canopy_engine::{
    run_threads, CpuBackend, MergeCollective, Problem, RunConfig, RunReport, Strategy,
};
use clap::{Args, Subcommand, ValueEnum};
use serde::Serialize;
use std::time::Duration;

#[derive(Subcommand)]
pub enum BenchCommand {
    /// Sequence-sharded decode attention: tree vs ring over p ranks, against the f64 oracle.
    Attention(AttentionArgs),
    /// The CUDA decode kernels on one GPU, swept over context length, against the memory floor.
    Kernel(crate::kernel_bench::KernelArgs),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendChoice {
    /// CUDA when a GPU is usable, else the CPU (with a note).
    Auto,
    Cpu,
    Cuda,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum StrategyChoice {
    Tree,
    Ring,
    All,
}

#[derive(Args)]
pub struct AttentionArgs {
    #[arg(long, value_enum, default_value = "auto")]
    backend: BackendChoice,
    /// Ranks (threads of this process, one per GPU on CUDA).
    #[arg(long, default_value_t = 4)]
    ranks: usize,
    /// Context length of each request.
    #[arg(long, default_value_t = 32768)]
    seq_len: u32,
    /// Independent requests, each sharded over all ranks.
    #[arg(long, default_value_t = 1)]
    batch: u32,
    #[command(flatten)]
    shape: ShapeArgs,
    #[arg(long, value_enum, default_value = "all")]
    strategy: StrategyChoice,
    /// Tree merge: allreduce3, allreduce2, allgather or all.
    #[arg(long, default_value = "all")]
    collective: String,
    /// Planner for each rank's local partials.
    #[arg(long, default_value = "q-guided")]
    method: Method,
    #[arg(long, default_value_t = 5)]
    iters: usize,
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Seconds a rank waits for its peers before failing.
    #[arg(long, default_value_t = 120.0)]
    timeout: f64,
    #[arg(long, default_value_t = 42)]
    seed: u64,
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct Row {
    strategy: String,
    ranks: usize,
    seq_len: u32,
    batch: u32,
    median_ms: f64,
    p10_ms: f64,
    p90_ms: f64,
    kv_bytes_per_rank: u64,
    comm_bytes_per_rank: u64,
    /// Ring on CUDA: NCCL send/recv bandwidth measured alone (GB/s sent per rank).
    link_gbps: Option<f64>,
    rel_error: Option<f64>,
}

#[derive(Serialize)]
struct AttentionOutput {
    backend: &'static str,
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    dtype: canopy_core::DType,
    method: Method,
    iters: usize,
    rows: Vec<Row>,
}

/// Largest problem (elements of K) for which the f64 oracle is computed.
const ORACLE_MAX_ELEMS: u64 = 1 << 27;

pub fn run(cmd: BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::Attention(a) => attention(a),
        BenchCommand::Kernel(a) => crate::kernel_bench::run(a),
    }
}

/// Resolves `auto` (CUDA when a GPU and NVRTC are usable, else the CPU with a note) and
/// refuses `cuda` with the reason when it cannot run here.
pub fn resolve_backend(choice: BackendChoice) -> Result<&'static str> {
    let cuda = || {
        let n = canopy_cuda::probe::device_count()?;
        if canopy_cuda::probe::nvrtc_present() {
            Ok(n)
        } else {
            Err(canopy_cuda::CudaError::NoNvrtc)
        }
    };
    match choice {
        BackendChoice::Cpu => Ok("cpu"),
        BackendChoice::Cuda => Ok(cuda().map(|_| "cuda")?),
        BackendChoice::Auto => match cuda() {
            Ok(_) => Ok("cuda"),
            Err(e) => {
                eprintln!("note: running on the CPU backend ({e})");
                Ok("cpu")
            }
        },
    }
}

/// Tree and ring on CPU ranks (threads of this process), against the f64 oracle.
fn cpu_rows(a: &AttentionArgs, spec: &WorkloadSpec) -> Result<Vec<Row>> {
    let problem = Problem::random(spec.build_tree()?, spec.shape, spec.dtype, a.seed);
    let elems = problem.tree.total_tokens() as u64 * spec.shape.kv_token_elems() as u64;
    let oracle = (elems <= ORACLE_MAX_ELEMS).then(|| problem.oracle());
    let mut rows = Vec::new();
    for strategy in strategies(a.strategy, &a.collective)? {
        let cfg = RunConfig {
            ranks: a.ranks,
            strategy,
            method: a.method,
            planner: PlannerConfig::default(),
            warmup: a.warmup,
            iters: a.iters,
            timeout: Duration::from_secs_f64(a.timeout),
            poison: false,
        };
        let r: RunReport = run_threads(&problem, &cfg, oracle.as_deref(), |_| Ok(CpuBackend))?;
        let ms: Vec<f64> = r.latencies_s.iter().map(|s| s * 1e3).collect();
        rows.push(Row {
            strategy: r.strategy,
            ranks: a.ranks,
            seq_len: a.seq_len,
            batch: a.batch,
            median_ms: quantile(&ms, 0.5),
            p10_ms: quantile(&ms, 0.1),
            p90_ms: quantile(&ms, 0.9),
            kv_bytes_per_rank: r.kv_bytes_per_rank,
            comm_bytes_per_rank: r.comm_bytes_per_rank,
            link_gbps: None,
            rel_error: r.rel_error,
        });
    }
    Ok(rows)
}

/// Tree and ring over GPUs 0..ranks with NCCL, KV generated on each GPU, against the f64
/// oracle regenerated on the CPU.
fn cuda_rows(a: &AttentionArgs, spec: &WorkloadSpec) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    for strategy in strategies(a.strategy, &a.collective)? {
        let cfg = canopy_cuda::distributed::DistributedConfig {
            ranks: a.ranks,
            strategy,
            shape: spec.shape,
            dtype: spec.dtype,
            seq_len: a.seq_len,
            batch: a.batch,
            iters: a.iters,
            check: true,
            seed: a.seed,
        };
        let r = canopy_cuda::distributed::run(&cfg)?;
        rows.push(Row {
            strategy: r.strategy,
            ranks: a.ranks,
            seq_len: a.seq_len,
            batch: a.batch,
            median_ms: r.median_ms,
            p10_ms: r.p10_ms,
            p90_ms: r.p90_ms,
            kv_bytes_per_rank: r.kv_bytes_per_rank,
            comm_bytes_per_rank: r.comm_bytes_per_rank,
            link_gbps: r.link_gbps,
            rel_error: r.rel_error,
        });
    }
    Ok(rows)
}

fn strategies(s: StrategyChoice, collective: &str) -> Result<Vec<Strategy>> {
    let collectives: Vec<MergeCollective> = if collective == "all" {
        MergeCollective::ALL.to_vec()
    } else {
        collective
            .split(',')
            .map(|c| c.trim().parse())
            .collect::<Result<_, String>>()
            .map_err(anyhow::Error::msg)?
    };
    let tree = collectives.into_iter().map(Strategy::Tree);
    Ok(match s {
        StrategyChoice::Tree => tree.collect(),
        StrategyChoice::Ring => vec![Strategy::Ring],
        StrategyChoice::All => tree.chain([Strategy::Ring]).collect(),
    })
}

fn attention(a: AttentionArgs) -> Result<()> {
    if a.ranks == 0 {
        bail!("--ranks must be at least 1");
    }
    let backend = resolve_backend(a.backend)?;
    let mut spec = WorkloadSpec::load("long")?.with_overrides(Overrides {
        seq_len: Some(a.seq_len),
        batch: Some(a.batch),
        prompt_len: None,
    })?;
    a.shape.apply(&mut spec)?;
    let rows = match backend {
        "cuda" => cuda_rows(&a, &spec)?,
        _ => cpu_rows(&a, &spec)?,
    };
    let out = AttentionOutput {
        backend,
        q_heads: spec.shape.q_heads,
        kv_heads: spec.shape.kv_heads,
        head_dim: spec.shape.head_dim,
        dtype: spec.dtype,
        method: a.method,
        iters: a.iters,
        rows,
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!(
        "decode attention on {} ({} ranks): {}/{} heads x {}, {}, {} iters",
        out.backend, a.ranks, out.q_heads, out.kv_heads, out.head_dim, out.dtype, out.iters
    );
    let mut t = Table::new(&[
        "strategy",
        "ranks",
        "N",
        "batch",
        "median ms",
        "p10 ms",
        "p90 ms",
        "KV/rank",
        "comm/rank",
        "link GB/s",
        "rel err vs f64",
    ]);
    for r in &out.rows {
        t.row(vec![
            r.strategy.clone(),
            r.ranks.to_string(),
            r.seq_len.to_string(),
            r.batch.to_string(),
            format!("{:.3}", r.median_ms),
            format!("{:.3}", r.p10_ms),
            format!("{:.3}", r.p90_ms),
            bytes(r.kv_bytes_per_rank),
            bytes(r.comm_bytes_per_rank),
            r.link_gbps.map_or("-".into(), |g| format!("{g:.0}")),
            r.rel_error
                .map_or("n/a (too large)".into(), |e| format!("{e:.2e}")),
        ]);
    }
    println!("{}", t.render());
    Ok(())
}

#[derive(Args)]
pub struct SelftestArgs {
    #[arg(long, value_enum, default_value = "auto")]
    backend: BackendChoice,
    /// Rank counts to run every case on.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    ranks: Vec<usize>,
    /// Random trees besides the named workloads.
    #[arg(long, default_value_t = 6)]
    cases: usize,
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// CUDA: also run every case with KV in pages of this many tokens (0: contiguous only).
    #[arg(long, default_value_t = 16)]
    page_size: u32,
}

pub fn selftest(a: SelftestArgs) -> Result<()> {
    let backend = resolve_backend(a.backend)?;
    let results = match backend {
        "cuda" => {
            // Ranks share the visible GPUs round-robin, so one GPU tests every rank count.
            let gpus = canopy_cuda::probe::device_count()?;
            let mut r = run_suite(
                |rank| Ok(canopy_cuda::CudaBackend::new(rank % gpus)?),
                &a.ranks,
                a.seed,
                a.cases,
            )?;
            if a.page_size > 0 {
                let paged = run_suite(
                    |rank| Ok(canopy_cuda::CudaBackend::new(rank % gpus)?.with_paging(a.page_size)?),
                    &a.ranks,
                    a.seed ^ 1,
                    a.cases,
                )?;
                r.extend(paged.into_iter().map(|mut c| {
                    c.name = format!("paged/{} {}", a.page_size, c.name);
                    c
                }));
            }
            r
        }
        _ => run_suite(|_| Ok(CpuBackend), &a.ranks, a.seed, a.cases)?,
    };
    let failed: Vec<_> = results.iter().filter(|r| !r.passed).collect();
    let worst = results.iter().map(|r| r.rel_error).fold(0.0, f64::max);
    for f in &failed {
        eprintln!(
            "FAIL {}: rel error {:.3e} (tolerance {:.0e})",
            f.name, f.rel_error, f.tolerance
        );
    }
    println!(
        "selftest on {backend}: {} passed, {} failed (worst relative error {worst:.2e})",
        results.len() - failed.len(),
        failed.len()
    );
    if !failed.is_empty() {
        bail!("{} conformance cases failed", failed.len());
    }
    Ok(())
}
