//! `canopy bench attention`, `canopy bench scaling` (rows from here) and `canopy selftest`.

use crate::plan_cmd::ShapeArgs;
use crate::table::{bytes, Table};
use anyhow::{bail, Result};
#[cfg(feature = "mpi")]
use canopy_comm::Group;
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
    /// Tree vs ring over a sweep of rank counts and context lengths: table, CSV, JSON, plot.
    Scaling(crate::scaling::ScalingArgs),
    /// The CUDA decode kernels on one GPU, swept over context length, against the memory floor.
    Kernel(crate::kernel_bench::KernelArgs),
    /// Tree-structured KV (shared prefixes): every planning method, timed and checked.
    Tree(crate::tree_cmd::TreeArgs),
    /// A model's decode step at long contexts, tree vs ring, beside the hardware's floor.
    Decode(crate::decode_bench::DecodeArgs),
    /// A load generator for `canopy serve`: latency, throughput, prefix-cache hits.
    Serve(crate::serve_bench::ServeBenchArgs),
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

/// What every distributed benchmark takes besides the rank count and context length.
#[derive(Args, Clone)]
pub struct RunArgs {
    #[arg(long, value_enum, default_value = "auto")]
    pub backend: BackendChoice,
    /// How ranks are started: threads of this process, or one process per rank under
    /// mpirun/srun. Default: mpi when mpirun or srun started several processes, else threads.
    #[arg(long, value_enum)]
    pub launcher: Option<Launcher>,
    /// Independent requests, each sharded over all ranks.
    #[arg(long, default_value_t = 1)]
    pub batch: u32,
    #[command(flatten)]
    pub shape: ShapeArgs,
    /// Tree, ring or both. The ring hands its shards off through NCCL, or on the copy engines
    /// over the peers' memory with `CANOPY_PEER_RING=on` (GPUs of one host).
    #[arg(long, value_enum, default_value = "all")]
    pub strategy: StrategyChoice,
    /// Tree merge: allreduce3, allreduce2, allgather, hierarchical, auto, a comma list, or all.
    /// On GPUs of one host that map each other's memory, allgather runs as one kernel over
    /// that memory (`CANOPY_PEER_MERGE=off`: NCCL's all-gather).
    #[arg(long, default_value = "all")]
    pub collective: String,
    /// Split the ranks into this many equal virtual nodes for the hierarchical merge (default:
    /// nodes are hosts).
    #[arg(long)]
    pub virtual_nodes: Option<usize>,
    /// Planner for each rank's local partials.
    #[arg(long, default_value = "q-guided")]
    pub method: Method,
    /// Timed decode steps per strategy; the median and p10/p90 are reported.
    #[arg(long, default_value_t = 5, value_parser = at_least_one)]
    pub iters: usize,
    /// Untimed steps before the timed ones.
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    /// Seconds a rank waits for its peers (CUDA: for a step, by its watchdog) before failing.
    #[arg(long, default_value_t = 120.0)]
    pub timeout: f64,
    /// Seed of the random queries, K and V.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// CUDA: check against the f64 oracle (recomputed on the CPU) only up to this many context
    /// tokens in all; longer runs report no error.
    #[arg(long, default_value_t = 4 << 20)]
    pub check_max_tokens: u64,
    /// Fault injection for tests: this rank stops before its first step, as if it had died.
    #[arg(long, hide = true)]
    pub stall_rank: Option<usize>,
    /// Print one JSON document instead of the table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args)]
pub struct AttentionArgs {
    #[command(flatten)]
    run: RunArgs,
    /// Ranks: threads of this process (one per GPU on CUDA), 4 by default; under mpirun or
    /// srun the world size (if given, it must match).
    #[arg(long)]
    ranks: Option<usize>,
    /// Context length of each request.
    #[arg(long, default_value_t = 32768, value_parser = clap::value_parser!(u32).range(1..))]
    seq_len: u32,
}

#[derive(Serialize)]
struct AttentionOutput {
    backend: BackendKind,
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    dtype: canopy_core::DType,
    method: Method,
    iters: usize,
    rows: Vec<RunReport>,
}

/// Largest problem (elements of K) for which the f64 oracle is computed.
const ORACLE_MAX_ELEMS: u64 = 1 << 27;

/// Whether the f64 oracle is computed for `tree`: up to [`ORACLE_MAX_ELEMS`].
fn oracle_fits(spec: &WorkloadSpec, tree: &canopy_core::KvTree) -> bool {
    u64::from(tree.total_tokens()) * spec.shape.kv_token_elems() as u64 <= ORACLE_MAX_ELEMS
}

pub fn run(cmd: BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::Attention(a) => attention(a),
        BenchCommand::Scaling(a) => crate::scaling::run(a),
        BenchCommand::Kernel(a) => crate::kernel_bench::run(a),
        BenchCommand::Tree(a) => crate::tree_cmd::run(a),
        BenchCommand::Decode(a) => crate::decode_bench::run(a),
        BenchCommand::Serve(a) => crate::serve_bench::run(a),
    }
}

/// The backend a command runs on, `auto` resolved.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    Cpu,
    Cuda,
}

impl std::fmt::Display for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            BackendKind::Cpu => "cpu",
            BackendKind::Cuda => "cuda",
        })
    }
}

/// Resolves `auto` (CUDA when a GPU and NVRTC are usable, else the CPU with a note) and
/// refuses `cuda` with the reason when it cannot run here.
pub fn resolve_backend(choice: BackendChoice) -> Result<BackendKind> {
    let cuda = || {
        let n = canopy_cuda::probe::device_count()?;
        if canopy_cuda::probe::nvrtc_present() {
            Ok(n)
        } else {
            Err(canopy_cuda::CudaError::NoNvrtc)
        }
    };
    match choice {
        BackendChoice::Cpu => Ok(BackendKind::Cpu),
        BackendChoice::Cuda => cuda()
            .map(|_| BackendKind::Cuda)
            .map_err(|e| anyhow::anyhow!("{e}; or run on the CPU with --backend cpu")),
        BackendChoice::Auto => match cuda() {
            Ok(_) => Ok(BackendKind::Cuda),
            Err(e) => {
                crate::launcher::note(format_args!("running on the CPU backend ({e})"));
                Ok(BackendKind::Cpu)
            }
        },
    }
}

/// Notes the options of `given` that were set (`true`) but have no effect in this run, and
/// `why`, so that a flag that changed nothing does not pass for one that did. A note, not a
/// `tracing` event: those show only under `RUST_LOG`.
pub(crate) fn note_no_effect(given: &[(&str, bool)], why: &str) {
    let set: Vec<&str> = given.iter().filter(|(_, s)| *s).map(|(f, _)| *f).collect();
    let (list, verb) = match set.as_slice() {
        [] => return,
        [one] => (one.to_string(), "has"),
        [rest @ .., last] => (format!("{} and {last}", rest.join(", ")), "have"),
    };
    crate::launcher::note(format_args!("{list} {verb} no effect: {why}"));
}

/// Notes that `--eager` (`eager`) changes nothing on the CPU (`kind`), which records no CUDA
/// graphs.
pub(crate) fn note_eager_unused(kind: BackendKind, eager: bool) {
    if kind == BackendKind::Cpu {
        note_no_effect(
            &[("--eager", eager)],
            "the CPU backend records no CUDA graphs and runs every step op by op anyway",
        );
    }
}

/// How this process takes part: the ranks are its threads, or it is one MPI rank.
pub enum World {
    Threads,
    #[cfg(feature = "mpi")]
    Mpi(canopy_comm::MpiComm),
}

impl World {
    /// `launcher` is `--launcher`; without it, MPI when mpirun or srun started several
    /// processes, and threads otherwise.
    pub fn new(launcher: Option<Launcher>) -> Result<World> {
        let launcher =
            crate::launcher::choose(launcher, crate::launcher::from_env(), cfg!(feature = "mpi"))?;
        match launcher {
            Launcher::Threads => Ok(World::Threads),
            #[cfg(feature = "mpi")]
            Launcher::Mpi => Ok(World::Mpi(canopy_comm::MpiComm::init()?)),
            #[cfg(not(feature = "mpi"))]
            Launcher::Mpi => bail!("this canopy was built without MPI; rebuild with `cargo build --release -p canopy-cli --features mpi` (needs OpenMPI and libclang)"),
        }
    }

    /// The rank count of a run: the MPI world size under mpirun/srun (`--ranks`, if given,
    /// must agree), else `--ranks` or `threads` threads.
    pub fn ranks(&self, requested: Option<usize>, threads: usize) -> Result<usize> {
        let ranks = match (self.mpi_size(), requested) {
            (Some(p), Some(r)) if r != p => {
                bail!("--ranks {r} but mpirun started {p} ranks; drop --ranks or make them agree")
            }
            (Some(p), _) => p,
            (None, r) => r.unwrap_or(threads),
        };
        if ranks == 0 {
            bail!("--ranks must be at least 1");
        }
        Ok(ranks)
    }

    /// This process's rank: 0 for threads (the process holds every rank).
    pub fn process_rank(&self) -> usize {
        match self {
            World::Threads => 0,
            #[cfg(feature = "mpi")]
            World::Mpi(c) => canopy_comm::Group::rank(c),
        }
    }

    /// The largest of `value` over the processes (itself for threads).
    pub fn max_over_processes(&self, value: u64) -> Result<u64> {
        match self {
            World::Threads => Ok(value),
            #[cfg(feature = "mpi")]
            World::Mpi(c) => {
                use canopy_comm::Collective;
                let mut v = [value];
                c.all_reduce(&mut v, canopy_comm::ReduceOp::Max)?;
                Ok(v[0])
            }
        }
    }

    /// The most ranks one device holds when `ranks` ranks run on nodes of `devices` devices,
    /// each rank on device `r % devices` of its node by its rank `r` there: threads are one
    /// node; under MPI the busiest node decides (a collective: every process calls it).
    pub fn ranks_per_device(&self, ranks: usize, devices: usize) -> Result<usize> {
        let on_node = match self {
            World::Threads => ranks,
            #[cfg(feature = "mpi")]
            World::Mpi(c) => c.busiest_node_ranks()?,
        };
        Ok(on_node.div_ceil(devices.max(1)))
    }

    /// The MPI world size, if this is an MPI rank.
    pub fn mpi_size(&self) -> Option<usize> {
        match self {
            World::Threads => None,
            #[cfg(feature = "mpi")]
            World::Mpi(c) => Some(canopy_comm::Group::size(c)),
        }
    }
}

/// Parses a count that must be at least 1 (timed iterations: zero runs have no timing).
pub fn at_least_one(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

/// Parses a sampling temperature: a finite number, at least 0 (0 decodes greedily).
pub fn temperature(s: &str) -> Result<f32, String> {
    match s.parse::<f32>() {
        Ok(t) if t.is_finite() && t >= 0.0 => Ok(t),
        Ok(_) => Err("must be a number of at least 0 (0 decodes greedily)".into()),
        Err(e) => Err(e.to_string()),
    }
}

/// Parses a temperature a request to an OpenAI-compatible server may carry: 0 to 2, the
/// API's range, which `canopy serve` holds requests to.
pub fn api_temperature(s: &str) -> Result<f32, String> {
    match temperature(s)? {
        t if t <= 2.0 => Ok(t),
        _ => {
            Err("must be at most 2, the OpenAI API's limit, which servers hold requests to".into())
        }
    }
}

/// Parses a nucleus-sampling mass: more than 0, at most 1 (1 keeps every token).
pub fn probability_mass(s: &str) -> Result<f32, String> {
    match s.parse::<f32>() {
        Ok(p) if p > 0.0 && p <= 1.0 => Ok(p),
        Ok(_) => Err("must be more than 0 and at most 1 (1 keeps every token)".into()),
        Err(e) => Err(e.to_string()),
    }
}

/// Parses a frequency or presence penalty: OpenAI's range.
pub fn penalty(s: &str) -> Result<f32, String> {
    let range = canopy_runtime::PENALTY_RANGE;
    match s.parse::<f32>() {
        Ok(p) if range.contains(&p) => Ok(p),
        Ok(_) => Err(format!(
            "must be from {} to {} (0: none)",
            range.start(),
            range.end()
        )),
        Err(e) => Err(e.to_string()),
    }
}

/// Parses a repetition penalty: more than 0 (1: none).
pub fn repetition_penalty(s: &str) -> Result<f32, String> {
    match s.parse::<f32>() {
        Ok(p) if p.is_finite() && p > 0.0 => Ok(p),
        Ok(_) => Err("must be more than 0 (1: none; above 1 discourages repeats)".into()),
        Err(e) => Err(e.to_string()),
    }
}

/// Parses how many likeliest tokens a log-probability reports beside its token.
pub fn logprobs_count(s: &str) -> Result<usize, String> {
    let most = canopy_runtime::LOGPROBS_MAX;
    match s.parse::<usize>() {
        Ok(n) if n <= most => Ok(n),
        Ok(_) => Err(format!("must be from 0 to {most}")),
        Err(e) => Err(e.to_string()),
    }
}

/// Parses a stop string: not empty (every text contains the empty string, so a sample would
/// end before its first token; the server refuses it too).
pub fn stop_string(s: &str) -> Result<String, String> {
    if s.is_empty() {
        Err("must not be empty: every text contains the empty string".into())
    } else {
        Ok(s.to_owned())
    }
}

/// The `long` workload at `seq_len` with the requested shape.
pub fn long_spec(run: &RunArgs, seq_len: u32) -> Result<WorkloadSpec> {
    let mut spec = WorkloadSpec::load("long")?.with_overrides(Overrides {
        seq_len: Some(seq_len),
        batch: Some(run.batch),
        prompt_len: None,
    })?;
    run.shape.apply(&mut spec)?;
    Ok(spec)
}

/// Every requested strategy at one (ranks, seq_len) point; `None` on MPI ranks other than 0.
pub fn rows(
    run: &RunArgs,
    world: &World,
    backend: BackendKind,
    ranks: usize,
    seq_len: u32,
) -> Result<Option<Vec<RunReport>>> {
    let spec = long_spec(run, seq_len)?;
    crate::plan_cmd::check_ranks(ranks, &spec.build_tree()?)?;
    let strategies = strategies(run.strategy, &run.collective)?;
    match world {
        World::Threads if backend == BackendKind::Cuda => strategies
            .into_iter()
            .map(|s| {
                let cfg = run.distributed_config(ranks, s, &spec, seq_len)?;
                Ok(canopy_cuda::distributed::run(&cfg)?)
            })
            .collect::<Result<Vec<_>>>()
            .map(Some),
        World::Threads => cpu_rows(run, &spec, ranks, &strategies).map(Some),
        #[cfg(feature = "mpi")]
        World::Mpi(comm) => mpi_rows(run, comm, &spec, backend, seq_len, &strategies),
    }
}

/// Tree and ring on CPU ranks (threads of this process), against the f64 oracle.
fn cpu_rows(
    run: &RunArgs,
    spec: &WorkloadSpec,
    ranks: usize,
    strategies: &[Strategy],
) -> Result<Vec<RunReport>> {
    let tree = spec.build_tree()?;
    let oracle = oracle_fits(spec, &tree);
    check_cpu_memory(spec, &tree, ranks, 1, strategies, oracle)?;
    let problem = Problem::random(tree, spec.shape, spec.dtype, run.seed);
    let oracle = oracle.then(|| problem.oracle());
    let mut rows = Vec::new();
    for &strategy in strategies {
        let cfg = run.run_config(ranks, strategy);
        rows.push(run_threads(&problem, &cfg, oracle.as_deref(), |_| {
            Ok(CpuBackend)
        })?);
    }
    Ok(rows)
}

/// Refuses a CPU run whose problem and ranks' buffers do not fit in this host's memory, before
/// anything large is allocated. `processes` share the ranks (1: threads of this process; the
/// world size under MPI, where each process holds the problem and its own rank's buffers).
pub fn check_cpu_memory(
    spec: &WorkloadSpec,
    tree: &canopy_core::KvTree,
    ranks: usize,
    processes: usize,
    strategies: &[Strategy],
    oracle: bool,
) -> Result<()> {
    use canopy_engine::memory::{cpu_ranks_bytes, ensure_host_fits, problem_bytes};
    let tokens = u64::from(tree.total_tokens());
    let problem = problem_bytes(&spec.shape, spec.dtype, tokens, oracle);
    let ranks_bytes = strategies
        .iter()
        .map(|&s| {
            cpu_ranks_bytes(
                &spec.shape,
                spec.dtype,
                tokens,
                tree.num_queries() as u64,
                ranks as u64,
                s,
            )
        })
        .max()
        .unwrap_or(0);
    let need = problem.saturating_add(ranks_bytes / processes as u64);
    let what = format!("{ranks} CPU ranks over {tokens} context tokens");
    Ok(ensure_host_fits(need, &what)?)
}

/// One process per rank under mpirun/srun, collectives over MPI (CPU backend) or NCCL (CUDA).
/// Every rank checks that all ranks were started with the same configuration; rank 0 returns
/// the rows.
#[cfg(feature = "mpi")]
fn mpi_rows(
    run: &RunArgs,
    comm: &canopy_comm::MpiComm,
    spec: &WorkloadSpec,
    backend: BackendKind,
    seq_len: u32,
    strategies: &[Strategy],
) -> Result<Option<Vec<RunReport>>> {
    use canopy_comm::Collective;
    use canopy_engine::rank_main;
    use canopy_engine::strategy::{gather_results, report};
    let p = comm.size();
    // Every rank must run the same problem: compare a hash of the configuration.
    let config = format!(
        "{backend} {:?} {:?} {seq_len} {} {:?} {} {:?} {:?} {} {} {}",
        spec.shape,
        spec.dtype,
        run.batch,
        run.strategy,
        run.collective,
        run.virtual_nodes,
        run.method,
        run.iters,
        run.warmup,
        run.seed
    );
    let hash = canopy_core::stats::fnv1a(&[config.as_bytes()]);
    let mut hashes = vec![0u8; 8 * p];
    comm.all_gather(&hash.to_le_bytes(), &mut hashes)?;
    if let Some(r) = hashes.chunks(8).position(|h| h != hash.to_le_bytes()) {
        bail!("rank {r} was started with a different configuration than rank {}: launch every rank with the same arguments", comm.rank());
    }
    let mut rows = Vec::new();
    if backend == BackendKind::Cuda {
        // One process per GPU: the same rank loop as the threads launcher, NCCL between
        // processes.
        for &strategy in strategies {
            let cfg = run.distributed_config(p, strategy, spec, seq_len)?;
            rows.extend(canopy_cuda::distributed::run_mpi(&cfg, comm)?);
        }
        return Ok((comm.rank() == 0).then_some(rows));
    }
    let tree = spec.build_tree()?;
    let oracle = comm.rank() == 0 && oracle_fits(spec, &tree);
    check_cpu_memory(spec, &tree, p, p, strategies, oracle)?;
    let problem = Problem::random(tree, spec.shape, spec.dtype, run.seed);
    let oracle = oracle.then(|| problem.oracle());
    for &strategy in strategies {
        let cfg = run.run_config(p, strategy);
        let mine = rank_main(&problem, &cfg, &CpuBackend, comm)?;
        if let Some(results) = gather_results(comm, mine)? {
            let (tree, shape) = (&problem.tree, &problem.shape);
            rows.push(report(tree, shape, &cfg, results, oracle.as_deref()));
        }
    }
    Ok((comm.rank() == 0).then_some(rows))
}

pub fn strategies(s: StrategyChoice, collective: &str) -> Result<Vec<Strategy>> {
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

impl RunArgs {
    /// The configuration for `ranks` GPUs running `strategy` with NCCL, over the hashed
    /// `long` workload (each rank generates its shard on its GPU).
    fn distributed_config(
        &self,
        ranks: usize,
        strategy: Strategy,
        spec: &WorkloadSpec,
        seq_len: u32,
    ) -> Result<canopy_cuda::distributed::DistributedConfig> {
        Ok(canopy_cuda::distributed::DistributedConfig {
            run: RunConfig {
                // One group per request: the backend splits it to fill the GPU.
                planner: PlannerConfig::whole_paths(),
                // Each rank's shard of a long context is far larger than L2.
                cache: canopy_engine::Cache::Warm,
                ..self.run_config(ranks, strategy)
            },
            problem: canopy_cuda::distributed::HashedProblem {
                tree: spec.build_tree()?,
                shape: spec.shape,
                dtype: spec.dtype,
                seed: self.seed,
            },
            kernels: canopy_cuda::KernelSettings::default(),
            check: seq_len as u64 * self.batch as u64 <= self.check_max_tokens,
        })
    }

    /// The engine's configuration for `ranks` ranks running `strategy`.
    fn run_config(&self, ranks: usize, strategy: Strategy) -> RunConfig {
        RunConfig {
            ranks,
            strategy,
            method: self.method,
            planner: PlannerConfig::default(),
            warmup: self.warmup,
            iters: self.iters,
            cache: canopy_engine::Cache::Warm,
            timeout: Duration::from_secs_f64(self.timeout),
            poison: false,
            virtual_nodes: self.virtual_nodes,
            stall_rank: self.stall_rank,
        }
    }
}

fn attention(a: AttentionArgs) -> Result<()> {
    let run = &a.run;
    let backend = resolve_backend(run.backend)?;
    let world = World::new(run.launcher)?;
    let ranks = world.ranks(a.ranks, 4)?;
    let spec = long_spec(run, a.seq_len)?;
    let Some(rows) = rows(run, &world, backend, ranks, a.seq_len)? else {
        return Ok(()); // only rank 0 reports
    };
    let out = AttentionOutput {
        backend,
        q_heads: spec.shape.q_heads,
        kv_heads: spec.shape.kv_heads,
        head_dim: spec.shape.head_dim,
        dtype: spec.dtype,
        method: run.method,
        iters: run.iters,
        rows,
    };
    if run.json {
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!(
        "decode attention on {} ({} ranks): {}/{} heads x {}, {}, {} iters",
        out.backend, ranks, out.q_heads, out.kv_heads, out.head_dim, out.dtype, out.iters
    );
    println!("{}", row_table(&out.rows).render());
    Ok(())
}

/// The rows as a terminal table.
pub fn row_table(rows: &[RunReport]) -> Table {
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
        "paper comm",
        "peak mem",
        "paper mem",
        "link GB/s",
        "rel err vs f64",
    ]);
    for r in rows {
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
            bytes(r.paper_comm_bytes),
            r.peak_mem_bytes.map_or("-".into(), bytes),
            bytes(r.paper_mem_bytes),
            r.link_gbps.map_or("-".into(), |g| format!("{g:.0}")),
            r.rel_error
                .map_or("n/a (too large)".into(), |e| format!("{e:.2e}")),
        ]);
    }
    t
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
    #[arg(long, default_value_t = SELFTEST_PAGE_SIZE)]
    page_size: u32,
    /// CUDA stage-1 kernel: auto, simt (CUDA cores) or mma (tensor cores wherever possible).
    #[arg(long, default_value = "auto")]
    kernel: canopy_cuda::KernelChoice,
}

/// The KV page size of the suite's paged CUDA run unless `--page-size` sets it.
const SELFTEST_PAGE_SIZE: u32 = 16;

pub fn selftest(a: SelftestArgs) -> Result<()> {
    let backend = resolve_backend(a.backend)?;
    if backend == BackendKind::Cpu {
        note_no_effect(
            &[
                ("--kernel", a.kernel != canopy_cuda::KernelChoice::default()),
                ("--page-size", a.page_size != SELFTEST_PAGE_SIZE),
            ],
            "the CPU backend runs its own attention path, not the CUDA kernels, over \
             contiguous KV (--backend cuda runs the kernels)",
        );
    }
    let results = match backend {
        BackendKind::Cuda => {
            // Ranks share the visible GPUs round-robin, so one GPU tests every rank count.
            let gpus = canopy_cuda::probe::device_count()?;
            let mut r = run_suite(
                |rank| Ok(canopy_cuda::CudaBackend::new(rank % gpus)?.with_kernel(a.kernel)),
                &a.ranks,
                a.seed,
                a.cases,
            )?;
            if a.page_size > 0 {
                let paged = run_suite(
                    |rank| {
                        Ok(canopy_cuda::CudaBackend::new(rank % gpus)?
                            .with_paging(a.page_size)?
                            .with_kernel(a.kernel))
                    },
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
    for r in results.iter().filter(|r| r.passed) {
        tracing::debug!("pass {}: rel error {:.3e}", r.name, r.rel_error);
    }
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
