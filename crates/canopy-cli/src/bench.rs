//! `canopy bench attention` and `canopy selftest`.

use crate::plan_cmd::ShapeArgs;
use crate::table::{bytes, Table};
use anyhow::{bail, Result};
use canopy_core::stats::quantile;
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

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Launcher {
    Threads,
    Mpi,
}

#[derive(Args)]
pub struct AttentionArgs {
    #[arg(long, value_enum, default_value = "auto")]
    backend: BackendChoice,
    /// Ranks: threads of this process (one per GPU on CUDA), 4 by default; under
    /// `--launcher mpi` the MPI world size (if given, it must match).
    #[arg(long)]
    ranks: Option<usize>,
    /// How ranks are started: threads of this process, or one process per rank under mpirun/srun.
    #[arg(long, value_enum, default_value = "threads")]
    launcher: Launcher,
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
        let cfg = a.run_config(a.ranks(), strategy);
        let r: RunReport = run_threads(&problem, &cfg, oracle.as_deref(), |_| Ok(CpuBackend))?;
        rows.push(Row::from_report(a, r));
    }
    Ok(rows)
}

impl Row {
    fn from_distributed(a: &AttentionArgs, r: canopy_cuda::distributed::DistributedReport) -> Row {
        Row {
            strategy: r.strategy,
            ranks: r.ranks,
            seq_len: a.seq_len,
            batch: a.batch,
            median_ms: r.median_ms,
            p10_ms: r.p10_ms,
            p90_ms: r.p90_ms,
            kv_bytes_per_rank: r.kv_bytes_per_rank,
            comm_bytes_per_rank: r.comm_bytes_per_rank,
            link_gbps: r.link_gbps,
            rel_error: r.rel_error,
        }
    }

    fn from_report(a: &AttentionArgs, r: RunReport) -> Row {
        let ms: Vec<f64> = r.latencies_s.iter().map(|s| s * 1e3).collect();
        Row {
            strategy: r.strategy,
            ranks: r.ranks,
            seq_len: a.seq_len,
            batch: a.batch,
            median_ms: quantile(&ms, 0.5),
            p10_ms: quantile(&ms, 0.1),
            p90_ms: quantile(&ms, 0.9),
            kv_bytes_per_rank: r.kv_bytes_per_rank,
            comm_bytes_per_rank: r.comm_bytes_per_rank,
            link_gbps: None,
            rel_error: r.rel_error,
        }
    }
}

/// One process per rank under mpirun/srun, CPU backend, collectives over MPI. Every rank checks
/// that all ranks were started with the same configuration; rank 0 returns the rows.
#[cfg(feature = "mpi")]
fn mpi_rows(a: &AttentionArgs, spec: &WorkloadSpec, backend: &str) -> Result<Option<Vec<Row>>> {
    use canopy_comm::{Collective, MpiComm};
    use canopy_engine::{rank_main, strategy::report, RankResult};
    let comm = MpiComm::init()?;
    let p = comm.size();
    if let Some(r) = a.ranks.filter(|&r| r != p) {
        bail!("--ranks {r} but mpirun started {p} ranks; drop --ranks or make them agree");
    }
    // Every rank must run the same problem: compare a hash of the configuration.
    let config = format!(
        "{:?} {:?} {} {} {:?} {} {:?} {} {} {}",
        spec.shape,
        spec.dtype,
        a.seq_len,
        a.batch,
        a.strategy,
        a.collective,
        a.method,
        a.iters,
        a.warmup,
        a.seed
    );
    let hash = canopy_core::stats::fnv1a(&[config.as_bytes()]);
    let mut hashes = vec![0u8; 8 * p];
    comm.all_gather(&hash.to_le_bytes(), &mut hashes)?;
    if let Some(r) = hashes.chunks(8).position(|h| h != hash.to_le_bytes()) {
        bail!("rank {r} was started with a different configuration than rank {}: launch every rank with the same arguments", comm.rank());
    }
    if backend == "cuda" {
        // One process per GPU: the same per-rank code as the threads launcher, NCCL between
        // processes.
        let mut rows = Vec::new();
        for strategy in strategies(a.strategy, &a.collective)? {
            let cfg = a.distributed_config(p, strategy, spec);
            if let Some(r) = canopy_cuda::distributed::run_mpi(&cfg, &comm)? {
                rows.push(Row::from_distributed(a, r));
            }
        }
        return Ok((comm.rank() == 0).then_some(rows));
    }
    let problem = Problem::random(spec.build_tree()?, spec.shape, spec.dtype, a.seed);
    let elems = problem.tree.total_tokens() as u64 * spec.shape.kv_token_elems() as u64;
    let oracle = (comm.rank() == 0 && elems <= ORACLE_MAX_ELEMS).then(|| problem.oracle());
    let mut rows = Vec::new();
    for strategy in strategies(a.strategy, &a.collective)? {
        let cfg = a.run_config(p, strategy);
        let mine = rank_main(&problem, &cfg, &CpuBackend, &comm)?;
        // Rank 0 needs every rank's output (to check they agree) and byte counts.
        let mut o = vec![0f32; mine.output.o.len() * p];
        comm.all_gather(&mine.output.o, &mut o)?;
        let mut lse = vec![0f32; mine.output.lse.len() * p];
        comm.all_gather(&mine.output.lse, &mut lse)?;
        let mut counts = vec![0u8; 16 * p];
        let own: Vec<u8> = [
            mine.kv_bytes.to_le_bytes(),
            mine.comm_bytes_per_step.to_le_bytes(),
        ]
        .concat();
        comm.all_gather(&own, &mut counts)?;
        if comm.rank() != 0 {
            continue;
        }
        let results: Vec<RankResult> = (0..p)
            .map(|r| {
                let word = |i: usize| {
                    u64::from_le_bytes(
                        counts[16 * r + 8 * i..16 * r + 8 * i + 8]
                            .try_into()
                            .expect("8 bytes"),
                    )
                };
                let (no, nl) = (mine.output.o.len(), mine.output.lse.len());
                let mut output = mine.output.clone();
                output.o.copy_from_slice(&o[r * no..(r + 1) * no]);
                output.lse.copy_from_slice(&lse[r * nl..(r + 1) * nl]);
                RankResult {
                    latencies: mine.latencies.clone(),
                    output,
                    kv_bytes: word(0),
                    comm_bytes_per_step: word(1),
                }
            })
            .collect();
        rows.push(Row::from_report(
            a,
            report(&cfg, results, oracle.as_deref()),
        ));
    }
    Ok((comm.rank() == 0).then_some(rows))
}

#[cfg(not(feature = "mpi"))]
fn mpi_rows(_: &AttentionArgs, _: &WorkloadSpec, _: &str) -> Result<Option<Vec<Row>>> {
    bail!("this canopy was built without MPI; rebuild with `cargo build --release -p canopy-cli --features mpi` (needs OpenMPI and libclang)")
}

/// Tree and ring over GPUs 0..ranks with NCCL, KV generated on each GPU, against the f64
/// oracle regenerated on the CPU.
fn cuda_rows(a: &AttentionArgs, spec: &WorkloadSpec) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    for strategy in strategies(a.strategy, &a.collective)? {
        let cfg = a.distributed_config(a.ranks(), strategy, spec);
        rows.push(Row::from_distributed(
            a,
            canopy_cuda::distributed::run(&cfg)?,
        ));
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

impl AttentionArgs {
    fn ranks(&self) -> usize {
        self.ranks.unwrap_or(4)
    }

    /// The configuration for `ranks` GPUs running `strategy` with NCCL.
    fn distributed_config(
        &self,
        ranks: usize,
        strategy: Strategy,
        spec: &WorkloadSpec,
    ) -> canopy_cuda::distributed::DistributedConfig {
        canopy_cuda::distributed::DistributedConfig {
            ranks,
            strategy,
            shape: spec.shape,
            dtype: spec.dtype,
            seq_len: self.seq_len,
            batch: self.batch,
            iters: self.iters,
            check: true,
            seed: self.seed,
        }
    }

    /// The engine's configuration for `ranks` CPU ranks running `strategy`.
    fn run_config(&self, ranks: usize, strategy: Strategy) -> RunConfig {
        RunConfig {
            ranks,
            strategy,
            method: self.method,
            planner: PlannerConfig::default(),
            warmup: self.warmup,
            iters: self.iters,
            timeout: Duration::from_secs_f64(self.timeout),
            poison: false,
        }
    }
}

fn attention(a: AttentionArgs) -> Result<()> {
    if a.ranks == Some(0) {
        bail!("--ranks must be at least 1");
    }
    let backend = resolve_backend(a.backend)?;
    let mut spec = WorkloadSpec::load("long")?.with_overrides(Overrides {
        seq_len: Some(a.seq_len),
        batch: Some(a.batch),
        prompt_len: None,
    })?;
    a.shape.apply(&mut spec)?;
    let rows = match (a.launcher, backend) {
        (Launcher::Mpi, _) => match mpi_rows(&a, &spec, backend)? {
            Some(rows) => rows,
            None => return Ok(()), // only rank 0 reports
        },
        (Launcher::Threads, "cuda") => cuda_rows(&a, &spec)?,
        (Launcher::Threads, _) => cpu_rows(&a, &spec)?,
    };
    let ranks = rows.first().map_or(a.ranks(), |r| r.ranks);
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
        out.backend, ranks, out.q_heads, out.kv_heads, out.head_dim, out.dtype, out.iters
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
