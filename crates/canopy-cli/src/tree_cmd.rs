//! `canopy bench tree`: tree-structured KV (shared prefixes) with every planning method.
//!
//! One rank: each method planned, run on the backend, checked against the f64 oracle and timed
//! (CUDA events on a GPU); speedups over Q-guided, the plan's analytic KV/Q/partial bytes, and
//! the tree's KV-read floor (each token of the tree once, at the measured copy bandwidth).
//! More ranks: the flattened tree split evenly over them, each rank planning its part, merged
//! across ranks (NCCL on CUDA, the engine's collectives on the CPU).

use crate::bench::{note_no_effect, resolve_backend, BackendChoice, BackendKind};
use crate::plan_cmd::{io_cells, ShapeArgs, SizeArgs, TreeSummary, IO_HEADER};
use crate::table::Table;
use anyhow::{bail, Result};
use canopy_core::data::{hashed_oracle, hashed_queries, HashedKv};
use canopy_core::{
    reference_attention, DeviceModel, IoReport, KvTree, Method, PlannerConfig, Shard, TreeView,
    WorkloadSpec,
};
use canopy_cuda::{CudaBackend, KernelChoice, KernelSettings, MmaPipeline};
use canopy_engine::tree_bench::{relate_to_q_guided, MethodRun, TreeBench};
use canopy_engine::{Backend, Cache, CpuBackend, MergeCollective, Problem, RunConfig, Strategy};
use canopy_kv::{KvManager, Placement, RankUpdate, StepLayout};
use clap::Args;
use serde::Serialize;
use std::time::Duration;

/// The KV page size of `--grow`'s pool unless `--page-size` sets it.
const GROW_PAGE_SIZE: u32 = 64;

/// The waves of resident CTAs a step is cut for unless `--waves` sets it.
const DEFAULT_WAVES: u32 = 1;

#[derive(Args)]
pub struct TreeArgs {
    /// A built-in workload (fasttree-0 … fasttree-9, few-shot-b20/-b30/-b50, tot-*, spec-t32 …
    /// spec-t256) or a TOML file.
    #[arg(long, required_unless_present = "sweep")]
    workload: Option<String>,
    /// q-guided, deft-node, deft-node-chunk, deft-flatten, fasttree, auto, a comma list, or all.
    #[arg(long, default_value = "all")]
    pub(crate) method: String,
    #[command(flatten)]
    pub(crate) shape: ShapeArgs,
    #[command(flatten)]
    pub(crate) sweep: crate::sweep::SweepArgs,
    #[command(flatten)]
    sizes: SizeArgs,
    /// Decode iterations of a growing tree (CUDA, one rank): every live leaf appends one token
    /// per iteration in a paged KV pool; an iteration that takes a new page is planned afresh,
    /// the others update the plan in place. Reports kernel and planning time at the first,
    /// middle and last iteration and summed. 0: the workload's tree as is.
    #[arg(long, default_value_t = 0)]
    grow: usize,
    /// KV page size of the growing tree's pool.
    #[arg(long, default_value_t = GROW_PAGE_SIZE)]
    page_size: u32,
    /// Ranks the flattened tree is split over (one GPU each on CUDA).
    #[arg(long, default_value_t = 1)]
    pub(crate) ranks: usize,
    /// Timed runs per method (after three warm-ups); the median is reported.
    #[arg(long, default_value_t = 20, value_parser = crate::bench::at_least_one)]
    pub(crate) iterations: usize,
    /// What each timed step finds in L2: cold (evicted before each step, outside the timed
    /// region, by writing a buffer, as in Triton's do_bench: L2 holds dirty lines), cold-clean
    /// (evicted by reading a buffer: L2 holds clean lines) or warm (the previous step's KV
    /// still there).
    #[arg(long, default_value = "cold")]
    cache: Cache,
    /// One rank: `auto` times the plans its device model cannot tell apart, and Q-guided (each
    /// five times, as `--cache` says), and runs the fastest instead of taking the model's pick;
    /// its planning time counts the timing.
    #[arg(long)]
    auto_timed: bool,
    #[arg(long, value_enum, default_value = "auto")]
    pub(crate) backend: BackendChoice,
    /// CUDA stage-1 kernel: auto (tensor cores for groups with several query rows), simt, mma.
    #[arg(long, default_value = "auto")]
    kernel: KernelChoice,
    /// CUDA: waves of resident CTAs a step's work is cut for (more waves: long groups are cut
    /// into more, shorter CTAs).
    #[arg(long, default_value_t = DEFAULT_WAVES)]
    waves: u32,
    /// CUDA: plan for at most this many resident CTAs per SM (fewer: long groups are cut into
    /// fewer, longer CTAs); default as many as fit, up to the backend's limit.
    #[arg(long)]
    ctas_per_sm: Option<u32>,
    /// CUDA: KV tokens per shared-memory tile of the many-row tensor-core kernel (32 or 64).
    #[arg(long, default_value_t = MmaPipeline::default().tile)]
    mma_tile: usize,
    /// CUDA: its shared-memory stages (2, 3 or 4): stages - 1 tiles are in flight per CTA.
    #[arg(long, default_value_t = MmaPipeline::default().stages)]
    mma_stages: usize,
    /// `auto`'s device model (TOML, as `canopy fit-model --out` writes) instead of the
    /// built-in H100 fit; one rank.
    #[arg(long)]
    device_model: Option<std::path::PathBuf>,
    /// Check every method against the f64 oracle.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    check: bool,
    /// Seed of the random KV and queries (and, with --sweep, of the random trees).
    #[arg(long, default_value_t = 7)]
    pub(crate) seed: u64,
    #[arg(long)]
    pub(crate) json: bool,
}

#[derive(Serialize)]
struct TreeOutput {
    #[serde(flatten)]
    tree: TreeSummary,
    backend: BackendKind,
    device: String,
    /// The stage-1 kernel asked for (GPU only; the CPU runs its own attention path).
    kernel: Option<KernelChoice>,
    ranks: usize,
    /// What each timed step found in L2 (GPU only; the CPU's caches are left as they are).
    cache: Option<Cache>,
    /// Device-to-device copy bandwidth (bytes read + written per second), CUDA only.
    copy_gbps: Option<f64>,
    /// The tree's K and V read once at the copy bandwidth, in microseconds.
    kv_floor_us: Option<f64>,
    methods: Vec<MethodRun>,
}

impl TreeArgs {
    fn pipeline(&self) -> MmaPipeline {
        MmaPipeline {
            tile: self.mma_tile,
            stages: self.mma_stages,
        }
    }

    /// The attention kernels' settings of these options, for every rank.
    fn kernel_settings(&self) -> KernelSettings {
        KernelSettings {
            kernel: self.kernel,
            waves: self.waves,
            ctas_per_sm: self.ctas_per_sm,
            pipeline: self.pipeline(),
        }
    }

    /// GPU 0 with the kernel settings of these options, for the runs on one rank.
    fn cuda_backend(&self) -> Result<CudaBackend> {
        Ok(CudaBackend::new(0)?.with_settings(self.kernel_settings())?)
    }

    /// Notes the options set that this run on `kind` leaves unused: the CUDA kernels'
    /// settings on the CPU, the device model beyond one rank and the page size of a tree that
    /// does not grow.
    pub(crate) fn note_unused(&self, kind: BackendKind) {
        if kind == BackendKind::Cpu {
            let pipeline = MmaPipeline::default();
            note_no_effect(
                &[
                    ("--kernel", self.kernel != KernelChoice::default()),
                    ("--waves", self.waves != DEFAULT_WAVES),
                    ("--ctas-per-sm", self.ctas_per_sm.is_some()),
                    ("--mma-tile", self.mma_tile != pipeline.tile),
                    ("--mma-stages", self.mma_stages != pipeline.stages),
                    ("--cache", self.cache != Cache::default()),
                ],
                "the CPU backend runs its own attention path, not the CUDA kernels, and leaves \
                 its caches as they are (--backend cuda runs the kernels)",
            );
        }
        if self.ranks > 1 {
            note_no_effect(
                &[("--device-model", self.device_model.is_some())],
                "`auto` prices each rank's plans with the built-in model beyond --ranks 1",
            );
        }
        if self.grow == 0 {
            note_no_effect(
                &[("--page-size", self.page_size != GROW_PAGE_SIZE)],
                "the pages are those of a growing tree's pool (--grow N)",
            );
        }
    }
}

pub fn run(a: TreeArgs) -> Result<()> {
    let Some(workload) = &a.workload else {
        return crate::sweep::run(&a);
    };
    let mut spec = WorkloadSpec::load(workload)?.with_overrides(a.sizes.overrides())?;
    a.shape.apply(&mut spec)?;
    let methods = Method::parse_list(&a.method)?;
    if a.grow > 0 {
        // A growing few-shot run starts at the first generated token (DeFT's iteration 1).
        if let canopy_core::TreeSpec::FewShot { generated, .. } = &mut spec.tree {
            *generated = 1;
        }
    }
    let tree = spec.build_tree()?;
    crate::plan_cmd::check_ranks(a.ranks, &tree)?;
    let backend = resolve_backend(a.backend)?;
    a.note_unused(backend);
    // The backends split long groups to fill the device; Q-guided keeps each path whole.
    let planner = PlannerConfig::whole_paths();
    if a.auto_timed && (a.ranks != 1 || a.grow > 0) {
        bail!("--auto-timed times one rank's plans of one tree: use --ranks 1 without --grow");
    }
    if a.grow > 0 {
        if backend != BackendKind::Cuda || a.ranks != 1 {
            bail!("--grow runs on one GPU: use --backend cuda and --ranks 1");
        }
        return grow(&a, &spec, &tree, &methods, planner);
    }
    let (device, copy, mut runs) = match (backend, a.ranks) {
        (_, 1) => {
            let one = OneRank::new(&a, backend)?;
            let copy = one.copy_bandwidth()?;
            let runs = one.bench(&a, &spec, &tree, &methods, planner)?;
            (one.device(), copy, runs)
        }
        (BackendKind::Cuda, p) => (
            "cuda".into(),
            None,
            cuda_ranks(&a, &spec, &tree, p, &methods, planner)?,
        ),
        (_, p) => (
            "cpu".into(),
            None,
            cpu_ranks(&a, &spec, &tree, p, &methods, planner)?,
        ),
    };
    let on_gpu = backend == BackendKind::Cuda;
    if !on_gpu {
        drop_cpu_predictions(&mut runs);
    }
    let kv_bytes = tree.total_tokens() as u64 * 2 * spec.shape.kv_token_bytes(spec.dtype) as u64;
    let out = TreeOutput {
        tree: TreeSummary::new(&spec, &tree),
        backend,
        device,
        kernel: on_gpu.then_some(a.kernel),
        ranks: a.ranks,
        cache: on_gpu.then_some(a.cache),
        copy_gbps: copy.map(|c| c / 1e9),
        kv_floor_us: copy.map(|c| kv_bytes as f64 / c * 1e6),
        methods: runs,
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!(
        "{} on {} ({} rank{}{}): {}{}",
        out.tree.workload,
        out.device,
        out.ranks,
        if out.ranks == 1 { "" } else { "s" },
        out.cache
            .map_or(String::new(), |c| format!(", {} L2", c.name())),
        out.tree,
        match (out.copy_gbps, out.kv_floor_us) {
            (Some(c), Some(f)) => format!("; copy {c:.0} GB/s, KV floor {f:.1} µs"),
            _ => String::new(),
        }
    );
    println!("{}", method_table(&out.methods).render());
    Ok(())
}

fn method_table(runs: &[MethodRun]) -> Table {
    let timing = [
        "plan ms",
        "median µs",
        "p10 µs",
        "p90 µs",
        "stage 1 µs",
        "speedup",
        "rel err",
    ];
    let mut t = Table::new(&[&["method"][..], &IO_HEADER, &timing].concat());
    for r in runs {
        let mut cells = vec![match (r.chosen, r.predicted_us) {
            (Some(m), Some(p)) => format!("{} ({m}; model {p:.0} µs)", r.method),
            (Some(m), None) => format!("{} ({m})", r.method),
            _ => r.method.to_string(),
        }];
        cells.extend(io_cells(&r.io, r.kv_vs_q_guided));
        cells.extend([
            format!("{:.2}", r.plan_ms),
            format!("{:.1}", r.median_us),
            format!("{:.1}", r.p10_us),
            format!("{:.1}", r.p90_us),
            r.stage1_us.map_or("-".into(), |x| format!("{x:.1}")),
            r.speedup_vs_q_guided
                .map_or("-".into(), |x| format!("{x:.2}x")),
            r.rel_error.map_or("-".into(), |e| format!("{e:.2e}")),
        ]);
        t.row(cells);
    }
    t
}

/// Every method on one rank's backend, over KV and queries already there.
#[allow(clippy::too_many_arguments)]
fn bench_on<B: Backend>(
    backend: &B,
    kv: &B::Kv,
    q: &B::Queries,
    spec: &WorkloadSpec,
    tree: &KvTree,
    methods: &[Method],
    planner: PlannerConfig,
    a: &TreeArgs,
    oracle: Option<&[f64]>,
) -> Result<Vec<MethodRun>> {
    let shard = Shard::whole(tree);
    let view = TreeView::new(tree, &shard);
    let bench = TreeBench {
        view: &view,
        shape: spec.shape,
        dtype: spec.dtype,
        planner,
        model: DeviceModel::load_or_default(a.device_model.as_deref())?,
        auto_timed: a.auto_timed,
        iters: a.iterations,
        cache: a.cache,
    };
    Ok(bench.run(backend, kv, q, methods, oracle)?)
}

/// `auto`'s device model prices plans on a GPU: its prediction says nothing of CPU time.
pub(crate) fn drop_cpu_predictions(runs: &mut [MethodRun]) {
    for r in runs {
        r.predicted_us = None;
    }
}

/// The one-rank backend trees are benchmarked on, made once for any number of trees.
pub(crate) enum OneRank {
    Cpu,
    Cuda(Box<CudaBackend>),
}

impl OneRank {
    pub(crate) fn new(a: &TreeArgs, kind: BackendKind) -> Result<OneRank> {
        Ok(match kind {
            BackendKind::Cpu => OneRank::Cpu,
            BackendKind::Cuda => OneRank::Cuda(Box::new(a.cuda_backend()?)),
        })
    }

    pub(crate) fn device(&self) -> String {
        match self {
            OneRank::Cpu => "cpu".into(),
            OneRank::Cuda(b) => b.gpu().name.clone(),
        }
    }

    /// Device-to-device copy bandwidth (bytes read + written per second), CUDA only.
    pub(crate) fn copy_bandwidth(&self) -> Result<Option<f64>> {
        Ok(match self {
            OneRank::Cpu => None,
            OneRank::Cuda(b) => Some(canopy_cuda::bench::measure_copy_bandwidth(b)?),
        })
    }

    /// Every method over `tree`, its KV and queries seeded by `--seed`.
    pub(crate) fn bench(
        &self,
        a: &TreeArgs,
        spec: &WorkloadSpec,
        tree: &KvTree,
        methods: &[Method],
        planner: PlannerConfig,
    ) -> Result<Vec<MethodRun>> {
        let (shape, dtype) = (spec.shape, spec.dtype);
        let tokens = tree.total_tokens() as usize;
        match self {
            OneRank::Cuda(backend) => {
                let backend = backend.as_ref();
                let mut kv = backend.alloc_kv(&shape, dtype, tokens)?;
                backend.fill_random(&mut kv, 0, tokens, a.seed, 0)?;
                let q = backend.upload_queries(
                    &shape,
                    &hashed_queries(&shape, dtype, tree.num_queries(), a.seed),
                )?;
                let want = a.check.then(|| hashed_oracle(tree, &shape, dtype, a.seed));
                bench_on(
                    backend,
                    &kv,
                    &q,
                    spec,
                    tree,
                    methods,
                    planner,
                    a,
                    want.as_deref(),
                )
            }
            OneRank::Cpu => {
                crate::bench::check_cpu_memory(spec, tree, 1, 1, &[], a.check)?;
                let problem = Problem::random(tree.clone(), shape, dtype, a.seed);
                let backend = CpuBackend;
                let mut kv = backend.alloc_kv(&shape, dtype, tokens)?;
                backend.write_kv(&mut kv, 0, &problem.data.k, &problem.data.v)?;
                let q = backend.upload_queries(&shape, &problem.data.q)?;
                let want = a.check.then(|| problem.oracle());
                bench_on(
                    &backend,
                    &kv,
                    &q,
                    spec,
                    tree,
                    methods,
                    planner,
                    a,
                    want.as_deref(),
                )
            }
        }
    }
}

/// A distributed run's result as a method row (its IO is rank 0's plan's).
fn distributed_row(method: Method, r: &canopy_engine::RunReport, io: IoReport) -> MethodRun {
    MethodRun {
        method,
        chosen: None,
        predicted_us: None,
        plan_ms: 0.0,
        io,
        median_us: r.median_ms * 1e3,
        p10_us: r.p10_ms * 1e3,
        p90_us: r.p90_ms * 1e3,
        stage1_us: None,
        speedup_vs_q_guided: None,
        kv_vs_q_guided: None,
        rel_error: r.rel_error,
    }
}

/// Rank 0's plan IO for `method` (what one rank reads).
fn rank0_io(
    tree: &KvTree,
    spec: &WorkloadSpec,
    ranks: usize,
    method: Method,
    planner: &PlannerConfig,
) -> Result<IoReport> {
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
    let strategy = Strategy::Tree(MergeCollective::Allreduce2);
    crate::bench::check_cpu_memory(spec, tree, ranks, 1, &[strategy], a.check)?;
    let problem = Problem::random(tree.clone(), spec.shape, spec.dtype, a.seed);
    let want = a.check.then(|| problem.oracle());
    let mut runs = Vec::new();
    for &method in methods {
        let cfg = RunConfig {
            ranks,
            strategy,
            method,
            planner,
            warmup: 1,
            iters: a.iterations,
            cache: a.cache,
            timeout: Duration::from_secs(120),
            poison: true,
            virtual_nodes: None,
            stall_rank: None,
        };
        let report =
            canopy_engine::run_threads(&problem, &cfg, want.as_deref(), |_| Ok(CpuBackend))?;
        runs.push(distributed_row(
            method,
            &report,
            rank0_io(tree, spec, ranks, method, &planner)?,
        ));
    }
    relate_to_q_guided(&mut runs);
    Ok(runs)
}

fn cuda_ranks(
    a: &TreeArgs,
    spec: &WorkloadSpec,
    tree: &KvTree,
    ranks: usize,
    methods: &[Method],
    planner: PlannerConfig,
) -> Result<Vec<MethodRun>> {
    let mut runs = Vec::new();
    for &method in methods {
        let cfg = canopy_cuda::distributed::DistributedConfig {
            run: RunConfig {
                ranks,
                strategy: Strategy::Tree(MergeCollective::Auto),
                method,
                // One group per path: the backend splits it to fill the GPU.
                planner: PlannerConfig::whole_paths(),
                warmup: 0,
                iters: a.iterations,
                cache: a.cache,
                timeout: Duration::from_secs(120),
                poison: false,
                virtual_nodes: None,
                stall_rank: None,
            },
            problem: canopy_cuda::distributed::HashedProblem {
                tree: tree.clone(),
                shape: spec.shape,
                dtype: spec.dtype,
                seed: a.seed,
            },
            kernels: a.kernel_settings(),
            check: a.check,
        };
        let r = canopy_cuda::distributed::run(&cfg)?;
        runs.push(distributed_row(
            method,
            &r,
            rank0_io(tree, spec, ranks, method, &planner)?,
        ));
    }
    relate_to_q_guided(&mut runs);
    Ok(runs)
}

/// One method over a growing tree.
#[derive(Serialize)]
struct GrowRun {
    method: Method,
    /// (iteration, median kernel microseconds, planning milliseconds) at the first, middle and
    /// last iteration.
    points: Vec<(usize, f64, f64)>,
    /// Median step time summed over every iteration, and planning time summed: the host's
    /// work before a step can launch (snapshot, plan, cut, upload of the plan and page table
    /// on a new layout; catch-up and the plan's in-place update otherwise).
    total_kernel_ms: f64,
    total_plan_ms: f64,
    /// Iterations that needed a new layout (a page taken, a fork, a prune) and were planned
    /// afresh, and the planning time they took; the rest updated the plan in place.
    replans: usize,
    replan_ms: f64,
    /// KV tokens read by the last iteration's plan.
    last_kv_tokens_read: u64,
    /// Against the f64 oracle at the last iteration.
    rel_error: Option<f64>,
}

#[derive(Serialize)]
struct GrowOutput {
    /// The tree the run starts from.
    #[serde(flatten)]
    tree: TreeSummary,
    device: String,
    iterations: usize,
    page_size: u32,
    /// Pool pages in use at the end (shared prefixes counted once).
    pages_in_use: usize,
    methods: Vec<GrowRun>,
}

/// The workload's tree in a one-rank paged pool, its queries' nodes marked live.
fn paged_tree(tree: &KvTree, page: u32, pool_pages: u32) -> Result<KvManager> {
    let mut p = KvManager::new(1, page, pool_pages)?;
    let mut ids = vec![0; tree.nodes().len()];
    for &n in tree.dfs_order() {
        let node = tree.node(n);
        ids[n as usize] = match node.parent {
            None => p.add_root(node.len(), Placement::Balanced)?,
            Some(parent) => p.fork(ids[parent as usize], node.len(), Placement::Balanced)?,
        };
    }
    for q in 0..tree.num_queries() as u32 {
        p.set_live(ids[tree.query_node(q) as usize], true)?;
    }
    Ok(p)
}

/// Everything made for a growing tree's current layout: the host plan (for its IO), the
/// device plan and the buffers sized by it.
struct Planned {
    host: canopy_core::Plan,
    dplan: canopy_cuda::CudaPlan,
    partials: canopy_cuda::CudaStates,
    out: canopy_cuda::CudaStates,
}

fn grow(
    a: &TreeArgs,
    spec: &WorkloadSpec,
    tree: &KvTree,
    methods: &[Method],
    planner: PlannerConfig,
) -> Result<()> {
    let backend = a.cuda_backend()?.with_paging(a.page_size)?;
    let (shape, dtype, page) = (spec.shape, spec.dtype, a.page_size);
    let live = tree.num_queries() as u32;
    // Room for the tree, every leaf's growth, and a partial page per node.
    let pool_pages = (tree.total_tokens() + live * a.grow as u32).div_ceil(page)
        + tree.nodes().len() as u32
        + live;
    let mut kv = backend.alloc_kv(&shape, dtype, (pool_pages * page) as usize)?;
    backend.fill_random(&mut kv, 0, (pool_pages * page) as usize, a.seed, 0)?;
    let marks = [1, a.grow.div_ceil(2), a.grow];
    let model = DeviceModel::load_or_default(a.device_model.as_deref())?;
    let mut runs = Vec::new();
    let mut pages_in_use = 0;
    for &method in methods {
        let mut paged = paged_tree(tree, page, pool_pages)?;
        let (mut total_kernel_ms, mut total_plan_ms) = (0.0, 0.0);
        let (mut replans, mut replan_ms) = (0, 0.0);
        let mut points = Vec::new();
        let mut last = None;
        let mut layout = StepLayout::new();
        let mut current: Option<Planned> = None;
        for it in 1..=a.grow {
            for n in paged.live() {
                // Token-tree queries sit on inner nodes; only leaves grow.
                let _ = paged.append(n, 1, Placement::Balanced);
            }
            let t0 = std::time::Instant::now();
            let plan_ms = match layout.update(&paged)?.pop().expect("one rank") {
                RankUpdate::Grown { tails, table } => {
                    let c = current.as_mut().expect("the first update is fresh");
                    if let Some(table) = table {
                        backend.set_page_table(&mut kv, table)?;
                    }
                    backend.extend_plan(&mut c.dplan, &tails)?;
                    let plan_ms = t0.elapsed().as_secs_f64() * 1e3;
                    c.host.extend_tails(&tails);
                    plan_ms
                }
                RankUpdate::Fresh(snap) => {
                    let shard = Shard::whole(&snap.tree);
                    let view = TreeView::new(&snap.tree, &shard);
                    let host = if method == Method::Auto {
                        canopy_core::choose(&view, &shape, &planner, &model)?.plan
                    } else {
                        canopy_core::plan(&view, method, &shape, &planner)?
                    };
                    backend.set_page_table(&mut kv, &snap.table)?;
                    let dplan = backend.upload_plan(&shape, &host)?;
                    let plan_ms = t0.elapsed().as_secs_f64() * 1e3;
                    let partials = backend.alloc_partials(&shape, &dplan)?;
                    let out = backend.alloc_states(&shape, snap.tree.num_queries())?;
                    current = Some(Planned {
                        host,
                        dplan,
                        partials,
                        out,
                    });
                    replans += 1;
                    replan_ms += plan_ms;
                    plan_ms
                }
            };
            total_plan_ms += plan_ms;
            let Planned {
                host,
                dplan,
                partials,
                out,
            } = current.as_mut().expect("planned above");
            let snap = layout.rank(0).expect("updated above");
            let nq = snap.tree.num_queries();
            let q_host = hashed_queries(&shape, dtype, nq, a.seed ^ it as u64);
            let q = backend.upload_queries(&shape, &q_host)?;
            let times = backend.time_steps(3, a.cache, &mut || {
                backend.step(&kv, &q, dplan, partials, out)
            })?;
            let kernel_us = canopy_core::stats::median(&times) * 1e3;
            total_kernel_ms += kernel_us / 1e3;
            if marks.contains(&it) {
                points.push((it, kernel_us, plan_ms));
            }
            if it == a.grow {
                let rel_error = if a.check {
                    let got = backend.download(out)?;
                    let pool = HashedKv {
                        seed: a.seed,
                        dtype,
                        kv_heads: shape.kv_heads,
                    };
                    let kv_src = canopy_core::PagedKv {
                        pool: &pool,
                        page_size: page,
                        table: &snap.table,
                    };
                    let want = reference_attention(&snap.tree, &shape, &q_host, &kv_src).0;
                    Some(canopy_core::relative_error(&got.o, &want))
                } else {
                    None
                };
                last = Some((host.io(&shape, dtype).kv_tokens_read, rel_error));
            }
        }
        pages_in_use = paged.pages_in_use();
        let (last_kv_tokens_read, rel_error) = last.expect("at least one iteration");
        runs.push(GrowRun {
            method,
            points,
            total_kernel_ms,
            total_plan_ms,
            replans,
            replan_ms,
            last_kv_tokens_read,
            rel_error,
        });
    }
    let out = GrowOutput {
        tree: TreeSummary::new(spec, tree),
        device: backend.gpu().name.clone(),
        iterations: a.grow,
        page_size: page,
        pages_in_use,
        methods: runs,
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!(
        "{} growing for {} iterations on {}: pages of {} tokens, {} in use at the end; {}/{} heads, {}",
        out.tree.workload, out.iterations, out.device, page, out.pages_in_use, shape.q_heads, shape.kv_heads, dtype
    );
    let mut t = Table::new(&[
        "method",
        "iteration: kernel µs / plan ms",
        "total kernel ms",
        "total plan ms",
        "plan / kernel",
        "replans: mean ms",
        "updates: mean ms",
        "KV tokens (last)",
        "rel err (last)",
    ]);
    for r in &out.methods {
        t.row(vec![
            r.method.to_string(),
            r.points
                .iter()
                .map(|(i, k, p)| format!("{i}: {k:.1} / {p:.2}"))
                .collect::<Vec<_>>()
                .join(", "),
            format!("{:.2}", r.total_kernel_ms),
            format!("{:.2}", r.total_plan_ms),
            format!("{:.0}%", 100.0 * r.total_plan_ms / r.total_kernel_ms),
            format!(
                "{}: {:.3}",
                r.replans,
                r.replan_ms / r.replans.max(1) as f64
            ),
            {
                let updates = out.iterations - r.replans;
                let ms = (r.total_plan_ms - r.replan_ms) / updates.max(1) as f64;
                format!("{updates}: {ms:.4}")
            },
            r.last_kv_tokens_read.to_string(),
            r.rel_error.map_or("-".into(), |e| format!("{e:.2e}")),
        ]);
    }
    println!("{}", t.render());
    Ok(())
}
