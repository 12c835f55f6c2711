//! `canopy bench decode`: a model's prefill and decode timed at long contexts, tree against
//! ring, beside what the hardware allows.
//!
//! Every run is one generation on `P` ranks (threads of this process, or the processes
//! mpirun or srun started, one per GPU): the context's KV (prefilled, or random
//! with `--context-fill random`), then `--decode` tokens. Each row reports the fill, the
//! prefill's tokens/s and achieved FLOP/s, the time to first token, the decode step (from one
//! token to the next on rank 0), the time to the last token (the paper's Table 1 sets the
//! tree's against the ring's), the tree's merge per layer, and the peak memory of the busiest
//! rank. Beside them, measured in the same run: the copy bandwidth, at which a step's floor
//! is priced (the bytes the busiest device must read: every weight and a share of the KV for
//! each rank on it), and the rate of a large GEMM, beside the prefill's. Before anything
//! runs, each rank count's longest context is priced on the device (`capacity`), and a longer
//! one is refused with the numbers.
//! On a GPU, an untimed short run of every configuration first compiles its kernels, so the
//! first row does not time NVRTC.

mod capacity;
mod cost;
mod predict;
mod report;

#[cfg(test)]
pub(crate) use report::fixtures;
pub use report::Report;

use crate::bench::{at_least_one, resolve_backend, BackendChoice, BackendKind, Launcher, World};
use crate::generate_cmd::DecodeChoice;
use crate::ranks::{ModelWeights, Placed, RankThreads};
use anyhow::{bail, Result};
use canopy_core::stats::{mean, median};
use canopy_core::{DType, Method};
use canopy_cuda::CudaBackend;
use canopy_engine::{
    measure_gemm_rate, Backend, CpuBackend, GemmShape, MergeCollective, ModelNeeds,
};
use canopy_model::LlamaConfig;
use canopy_runtime::{
    ContextFill, DecodeStrategy, GenerateRequest, Generated, SamplingParams, Watch,
    DEFAULT_PREFILL_CHUNK,
};
use clap::{Args, ValueEnum};
use report::{Row, RunInfo};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum FillChoice {
    /// Run the context through the model first (sequence-parallel prefill).
    Prefill,
    /// Random keys and values stand in for the context: decode timing at contexts whose
    /// prefill would not fit a run, even past the model's positions. The tokens generated
    /// mean nothing.
    Random,
}

impl FillChoice {
    fn name(self) -> &'static str {
        match self {
            FillChoice::Prefill => "prefill",
            FillChoice::Random => "random",
        }
    }

    /// The runtime's fill, a random one drawn from `seed`.
    pub(crate) fn context_fill(self, seed: u64) -> ContextFill {
        match self {
            FillChoice::Prefill => ContextFill::Prefill,
            FillChoice::Random => ContextFill::Random { seed },
        }
    }
}

/// A prompt of `tokens` ids counting up through the vocabulary: a timing reads its length,
/// not its ids. Refused past the 2^32 positions a model's KV addresses, or past the host's
/// memory, before it is built (its run is priced once it is).
pub(crate) fn stand_in_prompt(tokens: usize, config: &LlamaConfig) -> Result<Vec<u32>> {
    let Ok(tokens) = u32::try_from(tokens) else {
        bail!("a context of {tokens} tokens passes the 2^32 positions canopy addresses");
    };
    let what = format!("a stand-in prompt of {tokens} tokens");
    canopy_engine::memory::ensure_host_fits(tokens as u64 * 4, &what)?;
    Ok((0..tokens).map(|i| i % config.vocab_size as u32).collect())
}

/// Raises the model's positions to `longest` where a random fill runs past them (rotary
/// positions extend; a random context has no trained range to stay in); returns whether
/// they were raised. Refused past the 2^32 positions a model's KV addresses.
pub(crate) fn allow_positions(config: &mut LlamaConfig, longest: usize) -> Result<bool> {
    if u32::try_from(longest).is_err() {
        bail!("a context and its new tokens, {longest} positions, pass the 2^32 canopy addresses");
    }
    let past = longest > config.max_position_embeddings;
    if past {
        config.max_position_embeddings = longest;
    }
    Ok(past)
}

#[derive(Args)]
pub struct DecodeArgs {
    /// A Hugging Face model directory or a `.gguf` file.
    #[arg(long, required_unless_present_any = ["arch", "from"], conflicts_with = "arch")]
    model: Option<PathBuf>,
    /// A model shape without weights: llama-3.1-8b, llama-3.2-3b, llama-3.2-1b or smollm2-135m
    /// (needs --random-weights).
    #[arg(long, requires = "random_weights")]
    arch: Option<String>,
    /// Random weights of the model's shape instead of its own: with --arch, a preset shape's;
    /// with --model, that model's, whose config is read as usual but not its weights.
    #[arg(long)]
    random_weights: bool,
    /// Context lengths in tokens (K = 1024, M = 1024²), comma-separated [default: 8K; with
    /// --predict, none beyond the runs' own].
    #[arg(long, value_delimiter = ',', value_parser = parse_tokens)]
    context: Option<Vec<usize>>,
    /// Tokens decoded after the context.
    #[arg(long, default_value_t = 10, value_parser = at_least_one)]
    decode: usize,
    /// Rank counts, comma-separated: threads of this process (ranks beyond the GPUs share
    /// them) [default: 1]; under mpirun or srun, the world size (which the list must hold).
    #[arg(long, value_delimiter = ',', value_parser = at_least_one)]
    ranks: Option<Vec<usize>>,
    /// How ranks are started: threads of this process, or one process per rank (detected
    /// under mpirun/srun).
    #[arg(long, value_enum)]
    launcher: Option<Launcher>,
    /// Strategies, comma-separated.
    #[arg(long, value_delimiter = ',', value_enum, default_value = "tree")]
    strategy: Vec<DecodeChoice>,
    /// The tree's merges, comma-separated: allreduce3, allreduce2, allgather, hierarchical or
    /// auto; each is a row of its own. On GPUs of one host that map each other's memory,
    /// allgather runs as one kernel over that memory (`CANOPY_PEER_MERGE=off`: NCCL's
    /// all-gather).
    #[arg(long, value_delimiter = ',', default_value = "auto")]
    collective: Vec<MergeCollective>,
    #[arg(long, value_enum, default_value = "prefill")]
    context_fill: FillChoice,
    /// Prompt tokens each rank prefills in one pass (K = 1024).
    #[arg(long, value_parser = parse_tokens, default_value_t = DEFAULT_PREFILL_CHUNK)]
    prefill_chunk: usize,
    /// Run every decode step kernel by kernel, never replaying a recorded CUDA graph.
    #[arg(long)]
    eager: bool,
    #[arg(long, value_enum, default_value = "auto")]
    backend: BackendChoice,
    /// The dtype of the weights and the KV cache [default: f32 on the CPU, bf16 on a GPU].
    #[arg(long)]
    dtype: Option<DType>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Print one JSON document instead of the tables.
    #[arg(long)]
    json: bool,
    /// Write every row as CSV, with the run's fields on each.
    #[arg(long)]
    csv: Option<PathBuf>,
    /// Draw decode ms/token against the context, per strategy and rank count, with each rank
    /// count's floor (PNG or SVG, by extension).
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Predict the decode step at this rank count instead of running, from the `--from` runs'
    /// rows at fewer ranks (`canopy_engine::predict::DecodeModel`), at their contexts and
    /// --context's; rows measured at this count are set beside the prediction.
    #[arg(long, requires = "from",
          conflicts_with_all = ["model", "arch", "random_weights", "ranks", "eager", "csv", "plot"])]
    predict: Option<usize>,
    /// Saved `bench decode --json` outputs of one model on one kind of GPU, comma-separated,
    /// for --predict.
    #[arg(long, value_delimiter = ',', requires = "predict")]
    from: Vec<PathBuf>,
}

impl DecodeArgs {
    fn contexts(&self) -> Vec<usize> {
        self.context.clone().unwrap_or_else(|| vec![8 << 10])
    }
}

/// `8192`, `8K`, `1M`: a token count.
pub(crate) fn parse_tokens(s: &str) -> Result<usize, String> {
    let (digits, unit) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1 << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        _ => (s, 1),
    };
    match digits.parse::<usize>() {
        Ok(0) => Err("a context must hold at least one token".into()),
        Ok(n) => n
            .checked_mul(unit)
            .ok_or_else(|| format!("{s} tokens is too many")),
        Err(_) => Err(format!("{s:?} is not a token count (e.g. 8192, 32K, 1M)")),
    }
}

/// The model a run measures.
struct Subject {
    name: String,
    /// The model's shape; a random fill past its positions raises them to the longest context.
    config: LlamaConfig,
    source: ModelWeights,
    past_positions: bool,
}

impl Subject {
    fn open(a: &DecodeArgs, dtype: DType) -> Result<Subject> {
        let model = crate::ranks::ModelSource::open(
            a.model.as_deref(),
            a.arch.as_deref(),
            a.random_weights,
            dtype,
            a.seed,
        )?;
        let (name, mut config, source) = (model.name, model.config, model.weights);
        let longest = (a.contexts().iter().max().copied().unwrap_or(1)).saturating_add(a.decode);
        if longest > config.max_position_embeddings && a.context_fill == FillChoice::Prefill {
            bail!(
                "a context of {} tokens plus {} decoded exceeds the model's capacity of {} tokens; use shorter --context, or --context-fill random to time decode past it",
                longest - a.decode,
                a.decode,
                config.max_position_embeddings
            );
        }
        let past_positions = allow_positions(&mut config, longest)?;
        Ok(Subject {
            name,
            config,
            source,
            past_positions,
        })
    }
}

/// What `bench decode` measures of a backend's device besides the runs.
trait Device: RankThreads {
    /// Rows of the GEMM whose rate is measured: a long prefill's on a GPU, fewer on the CPU,
    /// whose rate does not grow with the rows while its time does.
    const GEMM_ROWS: usize;
    const GEMM_RUNS: usize;
    /// Whether the backend compiles kernels on their first use (NVRTC), which a warm-up keeps
    /// out of the timed rows.
    const COMPILES_KERNELS: bool;
    /// The copy bandwidth (bytes/s) a step's floor is priced at, where it is measured.
    fn copy_bandwidth(&self) -> Result<Option<f64>>;
}

impl Device for CpuBackend {
    const GEMM_ROWS: usize = 256;
    const GEMM_RUNS: usize = 3;
    const COMPILES_KERNELS: bool = false;
    fn copy_bandwidth(&self) -> Result<Option<f64>> {
        Ok(None)
    }
}

impl Device for CudaBackend {
    const GEMM_ROWS: usize = 8192;
    const GEMM_RUNS: usize = 20;
    const COMPILES_KERNELS: bool = true;
    fn copy_bandwidth(&self) -> Result<Option<f64>> {
        Ok(Some(canopy_cuda::bench::measure_copy_bandwidth(self)?))
    }
}

/// How the peak memory is measured where the backend reports its device's use, and where it
/// does not (the CPU).
const DEVICE_PEAK: &str = "device memory in use on the busiest rank's GPU beyond what was in use when its backend was made (weights included), sampled after each layer of the context's fill and at each token; ranks sharing a GPU count together";
const HOST_PEAK: &str = "the peak resident memory (VmHWM) of the busiest process: every rank together where the ranks are threads of one process";

pub fn run(a: DecodeArgs) -> Result<()> {
    if let Some(p) = a.predict {
        return predict::run(&a.from, p, a.context.as_deref().unwrap_or_default(), a.json);
    }
    // A plot that cannot be written is refused here, not after the runs.
    if let Some(path) = &a.plot {
        crate::plot::check(path)?;
    }
    let kind = resolve_backend(a.backend)?;
    crate::bench::note_eager_unused(kind, a.eager);
    let world = World::new(a.launcher)?;
    let ranks = rank_counts(world.mpi_size(), a.ranks.as_deref())?;
    let dtype = a.dtype.unwrap_or(match kind {
        BackendKind::Cpu => DType::F32,
        BackendKind::Cuda => DType::Bf16,
    });
    let subject = Subject::open(&a, dtype)?;
    let report = match kind {
        BackendKind::Cpu => {
            let on = Ranks {
                world: &world,
                counts: &ranks,
                devices: 1,
            };
            bench(&a, subject, dtype, kind, &|_| Ok(CpuBackend), on)?
        }
        BackendKind::Cuda => {
            let gpus = canopy_cuda::probe::device_count()?;
            let backend = |ordinal: usize| -> Result<CudaBackend> {
                Ok(CudaBackend::new(ordinal)?.with_paging(crate::generate_cmd::PAGE_SIZE)?)
            };
            let on = Ranks {
                world: &world,
                counts: &ranks,
                devices: gpus,
            };
            bench(&a, subject, dtype, kind, &backend, on)?
        }
    };
    let Some(report) = report else {
        return Ok(());
    };
    if let Some(path) = &a.csv {
        report.write_csv(path)?;
    }
    if let Some(path) = &a.plot {
        crate::plot::decode(&report, path)?;
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        report.print();
    }
    Ok(())
}

/// The rank counts to run: `--ranks` (default 1) with threads; under MPI (`mpi_size`) the
/// world size, which `--ranks`, if given, must hold (one launch per rank count).
fn rank_counts(mpi_size: Option<usize>, requested: Option<&[usize]>) -> Result<Vec<usize>> {
    match (mpi_size, requested) {
        (None, r) => Ok(r.map_or(vec![1], <[usize]>::to_vec)),
        (Some(p), None) => Ok(vec![p]),
        (Some(p), Some(r)) if r.contains(&p) => Ok(vec![p]),
        (Some(p), Some(r)) => {
            bail!("mpirun started {p} ranks but --ranks is {r:?}; launch once per rank count")
        }
    }
}

/// Where a bench's ranks run: the world, the rank counts to time, and the GPUs (rank `r` on
/// device `r % devices`).
struct Ranks<'a> {
    world: &'a World,
    counts: &'a [usize],
    devices: usize,
}

/// The request of one run: `context` tokens (any ids in the vocabulary: a timing does not
/// read them), then `--decode` tokens.
fn request(
    a: &DecodeArgs,
    config: &LlamaConfig,
    dtype: DType,
    context: usize,
    strategy: DecodeStrategy,
) -> Result<GenerateRequest> {
    Ok(GenerateRequest {
        prompt: stand_in_prompt(context, config)?,
        max_tokens: a.decode,
        samples: 1,
        sampling: SamplingParams::default(),
        seed: a.seed,
        stop_tokens: Vec::new(),
        strategy,
        method: Method::Auto,
        page_size: crate::generate_cmd::PAGE_SIZE,
        kv_dtype: dtype,
        context_fill: a.context_fill.context_fill(a.seed),
        prefill_chunk: a.prefill_chunk,
        graphs: !a.eager,
        logprobs: None,
    })
}

/// Every (context, ranks, strategy) configuration on backends made by `backend`, with the
/// device's rates measured on this process's first device first; the report on rank 0
/// (`None` on other MPI ranks).
fn bench<B: Device>(
    a: &DecodeArgs,
    subject: Subject,
    dtype: DType,
    kind: BackendKind,
    backend: &dyn Fn(usize) -> Result<B>,
    on: Ranks,
) -> Result<Option<Report>> {
    let (world, devices) = (on.world, on.devices);
    let config = &subject.config;
    let weight_bytes = config.weight_bytes(dtype);
    let probe = backend(world.process_rank() % devices)?;
    let bandwidth = probe.copy_bandwidth()?;
    let gemm = GemmShape {
        rows: B::GEMM_ROWS,
        cols: 2 * config.intermediate_size,
        inner: config.hidden_size,
    };
    let gemm_rate = measure_gemm_rate(&probe, gemm, dtype, B::GEMM_RUNS)?;
    // The measurements' buffers go back to the device before the ranks' backends note what
    // is in use without them.
    probe.synchronize()?;
    // Priced after the measurements, whose freed buffers the device's memory pool may keep:
    // as much is free here as when the ranks' backends check the same needs.
    let check = |needs: &ModelNeeds| Ok(probe.check_model(needs)?);
    let per_device = on
        .counts
        .iter()
        .map(|&ranks| Ok((ranks, world.ranks_per_device(ranks, devices)?)))
        .collect::<Result<Vec<_>>>()?;
    let capacity = capacity::price(a, &per_device, config, dtype, probe.name(), &check)?;
    drop(probe);

    let most = on.counts.iter().max().copied().unwrap_or(1);
    let longest = a.contexts().iter().max().copied().unwrap_or(1);
    let sizing = request(a, config, dtype, longest, DecodeStrategy::Ring)?;
    let needs = |here: usize| Ok(sizing.needs(config, dtype, most, here)?);
    let placed = Placed::new(
        world,
        most,
        devices,
        backend,
        config,
        subject.source.as_ref(),
        &needs,
    )?;
    if B::COMPILES_KERNELS {
        warm_up(a, &placed, world, config, dtype, on.counts)?;
    }
    let mut rows = Vec::new();
    let mut device_peaks = false;
    for &context in &a.contexts() {
        for &(ranks, per_device) in &per_device {
            for strategy in strategies(a) {
                let req = request(a, config, dtype, context, strategy)?;
                let name = strategy.name();
                let label = format!(
                    "{} of {context} tokens, p = {ranks}, {name}",
                    a.context_fill.name()
                );
                let (out, peak) = run_one(&placed, world, &req, ranks, &label, config)?;
                let Some(out) = out else {
                    continue;
                };
                device_peaks |= peak.on_device;
                let measured = Measured {
                    out: &out,
                    peak_bytes: peak.bytes,
                };
                let run = RunShape {
                    context,
                    ranks,
                    per_device,
                    strategy: name,
                    fill: a.context_fill,
                };
                rows.push(row(config, dtype, weight_bytes, bandwidth, run, measured));
            }
        }
    }
    let run = RunInfo {
        model: subject.name,
        backend: kind.to_string(),
        dtype: dtype.to_string(),
        weight_bytes,
        devices,
        copy_bandwidth_gb_s: bandwidth.map(|b| b / 1e9),
        gemm_tflops: gemm_rate / 1e12,
        gemm_shape: format!("{} × {} × {}", gemm.rows, gemm.cols, gemm.inner),
        peak_memory: if device_peaks { DEVICE_PEAK } else { HOST_PEAK },
    };
    Ok((world.process_rank() == 0)
        .then(|| Report::new(run, capacity, subject.past_positions, rows)))
}

/// Untimed runs of every strategy at every rank count, each of a short context (one prefill
/// chunk and a few tokens more, or the shortest context asked for) and two decoded tokens, so
/// that the kernels a configuration uses are compiled (on a cold kernel cache, seconds)
/// before any row is timed.
fn warm_up<B: RankThreads>(
    a: &DecodeArgs,
    placed: &Placed<B>,
    world: &World,
    config: &LlamaConfig,
    dtype: DType,
    rank_counts: &[usize],
) -> Result<()> {
    let shortest = a.contexts().iter().min().copied().unwrap_or(1);
    let context = shortest.min(a.prefill_chunk + 16);
    for &ranks in rank_counts {
        for strategy in strategies(a) {
            let req = GenerateRequest {
                max_tokens: 2,
                ..request(a, config, dtype, context, strategy)?
            };
            let label = format!("warm-up, p = {ranks}, {}", strategy.name());
            run_one(placed, world, &req, ranks, &label, config)?;
        }
    }
    Ok(())
}

/// The strategies to time, in order: the tree with each collective asked for, then the ring.
fn strategies(a: &DecodeArgs) -> Vec<DecodeStrategy> {
    a.strategy
        .iter()
        .flat_map(|choice| match choice {
            DecodeChoice::Tree => a
                .collective
                .iter()
                .map(|&c| DecodeStrategy::Tree(c))
                .collect(),
            DecodeChoice::Ring => vec![DecodeStrategy::Ring],
        })
        .collect()
}

/// The peak memory of a run: on the busiest rank's device where the backend reports it, else
/// the busiest process's resident memory.
struct Peak {
    bytes: Option<u64>,
    on_device: bool,
}

/// One generation of `req` on the first `ranks` ranks, its fill's progress on a bar labelled
/// `label`; returns rank 0's outcome (`None` on other MPI ranks) and the run's peak memory.
fn run_one<B: RankThreads>(
    placed: &Placed<B>,
    world: &World,
    req: &GenerateRequest,
    ranks: usize,
    label: &str,
    config: &LlamaConfig,
) -> Result<(Option<Generated>, Peak)> {
    canopy_engine::memory::reset_peak_resident();
    let bar = canopy_model::progress_bar(config.num_hidden_layers as u64, label.to_string());
    bar.set_message("passes (a layer of a piece of the prompt)");
    let peak = AtomicU64::new(0);
    let out = placed.run(world, ranks, req.strategy, &|b, l, comm| {
        let mut watch = RunWatch {
            backend: b,
            bar: (comm.rank() == 0).then_some(&bar),
            peak: None,
            failed: None,
        };
        let out = comm.generate(b, l, req, &mut watch)?;
        if let Some(e) = watch.failed {
            return Err(e.context("reading the device's memory in use"));
        }
        if let Some(p) = watch.peak {
            peak.fetch_max(p, Ordering::Relaxed);
        }
        Ok(out)
    })?;
    bar.finish_and_clear();
    let device = peak.into_inner();
    let local = match device {
        0 => canopy_engine::memory::peak_resident_bytes().unwrap_or(0),
        bytes => bytes,
    };
    // Every process takes part in the reduction, whatever it measured.
    let bytes = world.max_over_processes(local)?;
    let peak = Peak {
        bytes: (bytes > 0).then_some(bytes),
        on_device: device > 0,
    };
    Ok((out, peak))
}

/// One rank's watch of a run: the fill's progress (rank 0's bar), the backend's memory in use
/// sampled after each pass of the fill and at each token, and the tree's merges timed.
struct RunWatch<'a, B: Backend> {
    backend: &'a B,
    bar: Option<&'a indicatif::ProgressBar>,
    peak: Option<u64>,
    failed: Option<anyhow::Error>,
}

impl<B: Backend> RunWatch<'_, B> {
    fn sample(&mut self) {
        match self.backend.bytes_in_use() {
            Ok(Some(now)) => self.peak = Some(self.peak.unwrap_or(0).max(now)),
            Ok(None) => {}
            Err(e) => {
                self.failed.get_or_insert(e.into());
            }
        }
    }
}

impl<B: Backend> Watch for RunWatch<'_, B> {
    fn token(&mut self, _: usize, _: u32) -> bool {
        self.sample();
        true
    }

    fn context_progress(&mut self, done: usize, passes: usize) {
        if let Some(bar) = self.bar {
            bar.set_length(passes as u64);
            bar.set_position(done as u64);
        }
        self.sample();
    }

    fn time_merges(&self) -> bool {
        true
    }
}

/// Which configuration a row is.
struct RunShape {
    context: usize,
    ranks: usize,
    /// Ranks on the busiest device.
    per_device: usize,
    strategy: String,
    fill: FillChoice,
}

/// What one run measured.
struct Measured<'a> {
    out: &'a Generated,
    peak_bytes: Option<u64>,
}

/// The row of one run: its timings, set against the floor at `bandwidth` (bytes/s) and the
/// prefill's FLOPs. Ranks that share a device each read every weight and their share of the
/// KV through its one memory, so the floor counts every rank on the busiest device.
fn row(
    config: &LlamaConfig,
    dtype: DType,
    weight_bytes: u64,
    bandwidth: Option<f64>,
    run: RunShape,
    m: Measured,
) -> Row {
    let out = m.out;
    // Steps whose merges were timed waited for the device: they are left out of ms/token.
    let untimed: Vec<f64> = out
        .step_s
        .iter()
        .zip(&out.merge_s)
        .filter(|(_, merge)| merge.is_none())
        .map(|(s, _)| *s)
        .collect();
    let ms = (!untimed.is_empty()).then(|| median(&untimed) * 1e3);
    let mean_ms = (!untimed.is_empty()).then(|| mean(&untimed) * 1e3);
    let merges: Vec<f64> = out.merge_s.iter().flatten().copied().collect();
    let kv_bytes = cost::rank_kv_bytes(config, dtype, run.context, run.ranks);
    let device_bytes = run.per_device as u64 * (weight_bytes + kv_bytes);
    let floor_ms = bandwidth.map(|bw| device_bytes as f64 / bw * 1e3);
    let devices = run.ranks.div_ceil(run.per_device);
    let prefilled = run.fill == FillChoice::Prefill;
    let ttft_s = out.first_token_s.unwrap_or(out.prefill_s);
    Row {
        context: run.context,
        ranks: run.ranks,
        strategy: run.strategy,
        context_fill: run.fill.name(),
        fill_s: out.prefill_s,
        prefill_tokens_per_s: prefilled.then(|| run.context as f64 / out.prefill_s),
        prefill_tflops_per_device: prefilled.then(|| {
            cost::prefill_flops(config, run.context) / out.prefill_s / devices as f64 / 1e12
        }),
        ttft_s,
        decode_ms_per_token: ms,
        decode_mean_ms_per_token: mean_ms,
        decode_tokens_per_s: ms.map(|ms| 1e3 / ms),
        replayed_steps: out.replayed_steps,
        total_s: ttft_s + out.step_s.iter().sum::<f64>(),
        ranks_per_device: run.per_device,
        floor_ms,
        vs_floor: ms.zip(floor_ms).map(|(ms, f)| ms / f),
        merge_ms_per_layer: (!merges.is_empty())
            .then(|| median(&merges) * 1e3 / config.num_hidden_layers as f64),
        peak_bytes: m.peak_bytes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_counts_take_k_and_m() {
        assert_eq!(parse_tokens("8192"), Ok(8192));
        assert_eq!(parse_tokens("32K"), Ok(32768));
        assert_eq!(parse_tokens("1M"), Ok(1 << 20));
        assert!(parse_tokens("0").is_err());
        assert!(parse_tokens("lots").unwrap_err().contains("token count"));
    }

    /// Contexts past the 2^32 positions are refused before a prompt or a position table is
    /// made for them.
    #[test]
    fn contexts_past_32_bit_positions_are_refused() {
        let mut config = canopy_model::presets::preset("smollm2-135m").unwrap();
        let err = stand_in_prompt(1 << 32, &config).unwrap_err().to_string();
        assert!(err.contains("passes the 2^32 positions"), "{err}");
        assert_eq!(stand_in_prompt(3, &config).unwrap(), vec![0, 1, 2]);
        let err = allow_positions(&mut config, usize::MAX).unwrap_err();
        assert!(err.to_string().contains("pass the 2^32"), "{err}");
        assert!(allow_positions(&mut config, 1 << 20).unwrap());
        assert_eq!(config.max_position_embeddings, 1 << 20);
    }

    pub(super) fn parse(args: &[&str]) -> DecodeArgs {
        #[derive(clap::Parser)]
        struct Command {
            #[command(flatten)]
            decode: DecodeArgs,
        }
        let args = std::iter::once("decode").chain(args.iter().copied());
        <Command as clap::Parser>::try_parse_from(args)
            .unwrap()
            .decode
    }

    #[test]
    fn mpi_runs_the_world_size_that_ranks_must_hold() {
        assert_eq!(rank_counts(None, None).unwrap(), vec![1]);
        assert_eq!(rank_counts(None, Some(&[1, 2, 4])).unwrap(), vec![1, 2, 4]);
        assert_eq!(rank_counts(Some(4), None).unwrap(), vec![4]);
        assert_eq!(rank_counts(Some(4), Some(&[1, 2, 4])).unwrap(), vec![4]);
        let e = rank_counts(Some(4), Some(&[1, 2])).unwrap_err().to_string();
        assert!(e.contains("mpirun started 4 ranks"), "{e}");
    }

    #[test]
    fn every_collective_is_a_tree_row_and_the_ring_follows() {
        let a = parse(&[
            "--arch",
            "llama-3.1-8b",
            "--random-weights",
            "--strategy",
            "tree,ring",
            "--collective",
            "auto,allgather",
        ]);
        let names: Vec<String> = strategies(&a).iter().map(|s| s.name()).collect();
        assert_eq!(names, ["tree/auto", "tree/allgather", "ring"]);
    }

    /// Ranks that share a GPU each read every weight and their KV through it: the floor
    /// counts every rank on the busiest device, and the prefill's rate is per device used.
    #[test]
    fn the_floor_counts_every_rank_on_the_busiest_device() {
        let config = canopy_model::presets::preset("llama-3.2-1b").unwrap();
        let dtype = DType::Bf16;
        let weights = config.weight_bytes(dtype);
        let out = Generated {
            samples: vec![vec![1; 4]],
            stopped: vec![false],
            prefill_s: 2.0,
            first_token_s: Some(2.5),
            step_s: vec![0.010; 4],
            merge_s: vec![None; 4],
            first_logits: Vec::new(),
            top_two: Vec::new(),
            replayed_steps: 0,
            logprobs: Vec::new(),
        };
        let bandwidth = 4e12;
        let row_at = |ranks, per_device| {
            let run = RunShape {
                context: 1 << 20,
                ranks,
                per_device,
                strategy: "tree/auto".into(),
                fill: FillChoice::Prefill,
            };
            let measured = Measured {
                out: &out,
                peak_bytes: None,
            };
            row(&config, dtype, weights, Some(bandwidth), run, measured)
        };
        let kv = cost::rank_kv_bytes(&config, dtype, 1 << 20, 8) as f64;
        let (own, shared) = (row_at(8, 1), row_at(8, 4));
        let floor = (weights as f64 + kv) / bandwidth * 1e3;
        assert!((own.floor_ms.unwrap() - floor).abs() < 1e-9 * floor);
        assert!((shared.floor_ms.unwrap() - 4.0 * floor).abs() < 1e-9 * floor);
        assert_eq!((own.ranks_per_device, shared.ranks_per_device), (1, 4));
        let rate = |r: &Row| r.prefill_tflops_per_device.unwrap();
        assert!((rate(&shared) - 4.0 * rate(&own)).abs() < 1e-9 * rate(&shared));
    }
}
