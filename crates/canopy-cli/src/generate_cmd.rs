//! `canopy generate`: text from a Llama-family model, streamed as it is decoded.
//!
//! Without `--model` it runs SmolLM2-135M-Instruct, fetched once into the model cache. The
//! ranks are threads of this process, or MPI processes under mpirun/srun; every rank decodes
//! the same tokens and rank 0 prints them.

use crate::bench::BackendKind;
use crate::decode_bench::FillChoice;
use crate::ranks::{ModelSource, Placed, RankComm};
use anyhow::{bail, Result};
use canopy_core::stats::{mean, median};
use canopy_core::Method;
use canopy_cuda::CudaBackend;
use canopy_engine::{CpuBackend, LayerOps};
use canopy_model::{ChatMessage, Tokenizer};
use canopy_runtime::{
    GenerateRequest, Generated, ModelLayers, SamplingParams, TokenLogprobs, TopTwo,
    DEFAULT_PREFILL_CHUNK,
};
use clap::{Args, ValueEnum};
use serde::Serialize;
use std::io::Write;
use std::time::Instant;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DecodeChoice {
    /// Tree Attention: partial attention on every rank, merged by collectives.
    Tree,
    /// The ring baseline: every rank's KV passes every rank, through NCCL, or on the copy
    /// engines over the peers' memory with `CANOPY_PEER_RING=on` (GPUs of one host).
    Ring,
}

#[derive(Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    run: crate::ranks::ModelRunArgs,
    /// The prompt text.
    #[arg(
        long,
        required_unless_present_any = ["prompt_ids", "context"],
        conflicts_with_all = ["prompt_ids", "context"]
    )]
    prompt: Option<String>,
    /// The prompt as token ids (comma-separated), fed as they are: for checks against a
    /// reference that lists its prompts' ids.
    #[arg(long, value_delimiter = ',', conflicts_with_all = ["chat", "context"])]
    prompt_ids: Option<Vec<u32>>,
    /// A stand-in prompt of this many tokens (K = 1024, M = 1024²; ids counting up through
    /// the vocabulary), for long-context runs: what is generated after it means nothing, and
    /// every token asked for is decoded (no stop token ends it).
    #[arg(long, value_parser = crate::decode_bench::parse_tokens, conflicts_with = "chat")]
    context: Option<usize>,
    /// How the prompt's keys and values are made.
    #[arg(long, value_enum, default_value = "prefill")]
    context_fill: crate::decode_bench::FillChoice,
    /// Prompt tokens each rank prefills in one pass (K = 1024): the prefill's activations
    /// are bounded by this, not by the prompt.
    #[arg(long, value_parser = crate::decode_bench::parse_tokens, default_value_t = DEFAULT_PREFILL_CHUNK)]
    prefill_chunk: usize,
    /// Run every decode step kernel by kernel, never replaying a recorded CUDA graph.
    #[arg(long)]
    eager: bool,
    /// Wrap the prompt as a user message in the model's chat template.
    #[arg(long)]
    chat: bool,
    /// A system message before the prompt (with --chat).
    #[arg(long, requires = "chat")]
    system: Option<String>,
    /// Tokens to generate at most, per sample.
    #[arg(long, default_value_t = 128, value_parser = crate::bench::at_least_one)]
    max_tokens: usize,
    /// Sampling temperature; 0 decodes greedily.
    #[arg(long, default_value_t = 0.0, value_parser = crate::bench::temperature, allow_negative_numbers = true)]
    temperature: f32,
    /// Sample from the K most likely tokens only (0: all).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Sample from the most likely tokens whose probability reaches P (0 < P <= 1).
    #[arg(long, default_value_t = 1.0, value_parser = crate::bench::probability_mass, allow_negative_numbers = true)]
    top_p: f32,
    /// Taken from a token's logit for each time the sample drew it (-2 to 2).
    #[arg(long, default_value_t = 0.0, value_parser = crate::bench::penalty, allow_negative_numbers = true)]
    frequency_penalty: f32,
    /// Taken from a token's logit once the sample has drawn it (-2 to 2).
    #[arg(long, default_value_t = 0.0, value_parser = crate::bench::penalty, allow_negative_numbers = true)]
    presence_penalty: f32,
    /// Divides the positive logits, and multiplies the negative ones, of tokens the prompt
    /// holds or the sample drew (1: none).
    #[arg(long, default_value_t = 1.0, value_parser = crate::bench::repetition_penalty)]
    repetition_penalty: f32,
    /// Seed of the sampler; sample i of --n draws from seed + i.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Parallel samples of the prompt, decoded as one tree: the prompt's KV is stored once
    /// and read once per step for all of them.
    #[arg(long, default_value_t = 1, value_parser = crate::bench::at_least_one)]
    n: usize,
    /// End a sample when its text contains this (repeatable); the text stops before it.
    #[arg(long, value_parser = crate::bench::stop_string)]
    stop: Vec<String>,
    /// Planner of each rank's part of the KV tree.
    #[arg(long, default_value = "auto")]
    method: Method,
    /// Print one JSON document at the end instead of streaming text.
    #[arg(long)]
    json: bool,
    /// With --json: add the logits that chose the first token, and the two most likely
    /// tokens of each step of sample 0.
    #[arg(long, requires = "json")]
    logits: bool,
    /// With --json: each sample's tokens' log-probabilities (the model's own, before the
    /// temperature and cuts), each with its N likeliest tokens (0 to 20), reduced from each
    /// step's rows on the device.
    #[arg(long, requires = "json", value_parser = crate::bench::logprobs_count)]
    logprobs: Option<usize>,
}

impl GenerateArgs {
    /// Notes the options set that this run leaves unused: the sampler's cuts and seed when it
    /// decodes greedily (and that its samples are then alike), and `--eager` on the CPU, which
    /// records no graphs.
    fn note_unused(&self, kind: BackendKind) {
        if self.temperature <= 0.0 {
            crate::bench::note_no_effect(
                &[
                    ("--top-k", self.top_k != 0),
                    ("--top-p", self.top_p != 1.0),
                    // A random context fill draws its keys and values from the seed.
                    (
                        "--seed",
                        self.seed != 0 && self.context_fill != FillChoice::Random,
                    ),
                ],
                "--temperature 0 (the default) decodes greedily, the most likely token each \
                 step; give a temperature above 0 to sample",
            );
            if self.n > 1 {
                crate::launcher::note(format_args!(
                    "--n {} samples decode greedily (--temperature 0), so they are the same \
                     tokens; give a temperature above 0 for different samples",
                    self.n
                ));
            }
        }
        crate::bench::note_eager_unused(kind, self.eager);
    }
}

#[derive(Serialize)]
struct Report {
    model: String,
    backend: String,
    dtype: String,
    ranks: usize,
    strategy: String,
    prompt_tokens: usize,
    samples: Vec<SampleText>,
    /// Seconds to read the weights and place them on the backend, before the request.
    load_s: f64,
    prefill_s: f64,
    prefill_tokens_per_s: f64,
    /// Seconds from the request to its first token: the KV cache's allocation and the
    /// prefill, as `bench decode` and the server count it; the load is not in it.
    ttft_s: f64,
    /// The mean decode step: it counts the steps that record a graph or run op by op, and a
    /// first use of a library (cuBLAS) or a kernel.
    decode_ms_per_token: Option<f64>,
    /// The median decode step: the steady step, which a short run's first steps do not move.
    decode_median_step_ms: Option<f64>,
    decode_tokens_per_s: Option<f64>,
    /// Decode steps rank 0 replayed from a recorded graph (0 with `--eager`, or on a backend
    /// that records none).
    replayed_steps: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    logits: Option<Logits>,
}

/// What `--logits` adds to the report.
#[derive(Serialize)]
struct Logits {
    first: Vec<f32>,
    steps: Vec<TopTwo>,
}

#[derive(Serialize, Clone, Default)]
struct SampleText {
    text: String,
    tokens: Vec<u32>,
    /// `stop` (a stop token or string) or `length` (the token limit).
    finish_reason: &'static str,
    /// Each token's log-probability and its row's likeliest tokens, with `--logprobs`.
    #[serde(skip_serializing_if = "Option::is_none")]
    logprobs: Option<Vec<TokenLogprobs>>,
}

pub fn run(a: GenerateArgs) -> Result<()> {
    let crate::ranks::OpenedRun {
        world,
        ranks,
        kind,
        mut model,
        dtype,
    } = a.run.open()?;
    a.note_unused(kind);
    let prompt = match (a.context, &a.prompt_ids, &a.prompt) {
        (Some(tokens), _, _) => crate::decode_bench::stand_in_prompt(tokens, &model.config)?,
        (None, Some(ids), _) => ids.clone(),
        (None, None, Some(prompt)) if a.chat => {
            let mut messages = Vec::new();
            if let Some(s) = &a.system {
                messages.push(ChatMessage::new("system", s.as_str()));
            }
            messages.push(ChatMessage::new("user", prompt.as_str()));
            let text = model.chat_template()?.render(&messages, true)?;
            // A chat rendering carries its own special tokens.
            model.tokenizer.encode(&text, false)?
        }
        (None, None, Some(prompt)) => model.tokenizer.encode(prompt, true)?,
        (None, None, None) => bail!("give --prompt, --prompt-ids or --context"),
    };
    if a.context_fill == FillChoice::Random {
        let longest = prompt.len().saturating_add(a.max_tokens);
        crate::decode_bench::allow_positions(&mut model.config, longest)?;
    }
    let req = GenerateRequest {
        prompt,
        max_tokens: a.max_tokens,
        samples: a.n,
        sampling: SamplingParams {
            temperature: a.temperature,
            top_k: a.top_k,
            top_p: a.top_p,
            frequency_penalty: a.frequency_penalty,
            presence_penalty: a.presence_penalty,
            repetition_penalty: a.repetition_penalty,
        },
        seed: a.seed,
        // A stand-in prompt's run is a timing: it decodes every token asked for.
        stop_tokens: match a.context {
            Some(_) => Vec::new(),
            None => model.config.eos_token_ids.clone(),
        },
        strategy: a.run.strategy(),
        method: a.method,
        page_size: PAGE_SIZE,
        kv_dtype: dtype,
        context_fill: a.context_fill.context_fill(a.seed),
        prefill_chunk: a.prefill_chunk,
        graphs: !a.eager,
        logprobs: a.logprobs,
    };
    let run = Run {
        args: &a,
        req: &req,
        started: Instant::now(),
    };
    let ModelSource {
        name,
        path,
        config,
        weights: source,
        tokenizer,
        ..
    } = model;
    let needs = |here: usize| Ok(req.needs(&config, dtype, ranks, here)?);
    let done = match kind {
        BackendKind::Cpu => {
            let placed = Placed::new(
                &world,
                ranks,
                1,
                &|_| Ok(CpuBackend),
                &config,
                source.as_ref(),
                &needs,
            )?;
            placed.run(&world, ranks, req.strategy, &|b, l, comm| {
                run.rank(b, l, &tokenizer, comm)
            })?
        }
        BackendKind::Cuda => {
            let gpus = canopy_cuda::probe::device_count()?;
            let backend = |ordinal: usize| -> Result<CudaBackend> {
                Ok(CudaBackend::new(ordinal)?.with_paging(PAGE_SIZE)?)
            };
            let placed = Placed::new(
                &world,
                ranks,
                gpus,
                &backend,
                &config,
                source.as_ref(),
                &needs,
            )?;
            placed.run(&world, ranks, req.strategy, &|b, l, comm| {
                run.rank(b, l, &tokenizer, comm)
            })?
        }
    };
    let Some((out, texts, load_s)) = done else {
        return Ok(()); // an MPI rank other than 0
    };
    let stepped = !out.step_s.is_empty();
    let report = Report {
        model: path.map_or(name, |p| p.display().to_string()),
        backend: kind.to_string(),
        dtype: dtype.to_string(),
        ranks,
        strategy: req.strategy.name(),
        prompt_tokens: req.prompt.len(),
        samples: texts,
        load_s,
        prefill_s: out.prefill_s,
        prefill_tokens_per_s: req.prompt.len() as f64 / out.prefill_s,
        ttft_s: out.first_token_s.unwrap_or(out.prefill_s),
        decode_ms_per_token: stepped.then(|| mean(&out.step_s) * 1e3),
        decode_median_step_ms: stepped.then(|| median(&out.step_s) * 1e3),
        decode_tokens_per_s: stepped.then(|| a.n as f64 / mean(&out.step_s)),
        replayed_steps: out.replayed_steps,
        logits: a.logits.then(|| Logits {
            first: out.first_logits.clone(),
            steps: out.top_two.clone(),
        }),
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    if a.n > 1 {
        for (i, s) in report.samples.iter().enumerate() {
            println!("--- sample {i} ({}) ---\n{}", s.finish_reason, s.text);
        }
    } else {
        println!();
    }
    eprintln!(
        "weights loaded in {:.3} s; {} prompt tokens; {} {:.3} s ({:.1} tokens/s); first token after {:.3} s; decode {} on {} rank{} ({}, {} {})",
        report.load_s,
        report.prompt_tokens,
        match a.context_fill {
            FillChoice::Prefill => "prefill",
            FillChoice::Random => "random fill",
        },
        report.prefill_s,
        report.prefill_tokens_per_s,
        report.ttft_s,
        match (
            report.decode_ms_per_token,
            report.decode_median_step_ms,
            report.decode_tokens_per_s,
        ) {
            (Some(ms), Some(median), Some(tps)) => {
                format!("{ms:.1} ms/token, median step {median:.1} ms ({tps:.1} tokens/s)")
            }
            _ => "no steps".into(),
        },
        ranks,
        if ranks == 1 { "" } else { "s" },
        report.strategy,
        report.backend,
        report.dtype,
    );
    Ok(())
}

/// KV page size, in tokens.
pub const PAGE_SIZE: u32 = 16;

/// One rank's outcome as rank 0 reports it: the run, each sample's text and the seconds from
/// the start to the weights' placement.
type RankOutcome = (Generated, Vec<SampleText>, f64);

/// What every rank of this process shares.
struct Run<'a> {
    args: &'a GenerateArgs,
    req: &'a GenerateRequest,
    started: Instant,
}

impl Run<'_> {
    /// One rank's generation. Every rank decodes the text (to find stop strings alike); rank 0
    /// streams it when there is one sample and not `--json`. Returns the run, each sample's text
    /// and the seconds from `started` to this call, which follows the weights' placement.
    fn rank<B: LayerOps>(
        &self,
        backend: &B,
        layers: &ModelLayers<B>,
        tokenizer: &Tokenizer,
        comm: &dyn RankComm<B>,
    ) -> Result<RankOutcome> {
        let (a, req) = (self.args, self.req);
        let load_s = self.started.elapsed().as_secs_f64();
        let stream = comm.rank() == 0 && req.samples == 1 && !a.json;
        let mut decoders: Vec<_> = (0..req.samples)
            .map(|_| tokenizer.incremental_decoder(true))
            .collect();
        let mut texts = vec![String::new(); req.samples];
        let mut printed = vec![0usize; req.samples];
        let mut failure = None;
        let bar = (comm.rank() == 0).then(|| FillBar::new(layers.config.num_hidden_layers));
        let mut watch = FillBarWatch {
            bar: bar.as_ref(),
            tokens: |s: usize, token: u32| {
                match decoders[s].push(token) {
                    Ok(piece) => texts[s].push_str(&piece),
                    Err(e) => failure = Some(e),
                }
                let stop_at = a
                    .stop
                    .iter()
                    .filter_map(|x| texts[s].find(x.as_str()))
                    .min();
                if let Some(at) = stop_at {
                    texts[s].truncate(at);
                }
                if stream {
                    // Hold back what could still become a stop string.
                    let safe = stop_at
                        .unwrap_or_else(|| canopy_runtime::serving::held_back(&texts[s], &a.stop));
                    if safe > printed[s] {
                        print!("{}", &texts[s][printed[s]..safe]);
                        let _ = std::io::stdout().flush();
                        printed[s] = safe;
                    }
                }
                stop_at.is_none()
            },
        };
        let out = comm.generate(backend, layers, req, &mut watch);
        if let Some(bar) = &bar {
            bar.clear();
        }
        let out = out?;
        if let Some(e) = failure {
            return Err(e.into());
        }
        let samples = out
            .samples
            .iter()
            .zip(&out.stopped)
            .zip(texts)
            .enumerate()
            .map(|(i, ((tokens, &stopped), text))| SampleText {
                text,
                tokens: tokens.clone(),
                finish_reason: if stopped { "stop" } else { "length" },
                logprobs: self
                    .args
                    .logprobs
                    .and_then(|_| out.logprobs.get(i).cloned()),
            })
            .collect::<Vec<_>>();
        if stream && printed[0] < samples[0].text.len() {
            print!("{}", &samples[0].text[printed[0]..]);
        }
        Ok((out, samples, load_s))
    }
}

/// Rank 0's bar over the prompt's prefill, pass by pass (a layer of a piece of the prompt).
/// It is drawn only once the fill has run [`FillBar::AFTER`], so a short prompt draws nothing,
/// and cleared before the first token is printed.
struct FillBar {
    bar: indicatif::ProgressBar,
    started: Instant,
    shown: std::cell::Cell<bool>,
}

impl FillBar {
    /// How long a fill runs before its bar is drawn.
    const AFTER: std::time::Duration = std::time::Duration::from_millis(500);

    fn new(layers: usize) -> Self {
        let bar = canopy_model::progress_bar(layers as u64, "prefill".into());
        bar.set_message("passes (layer × piece)");
        let shown = std::cell::Cell::new(bar.is_hidden());
        if !shown.get() {
            bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
        }
        FillBar {
            bar,
            started: Instant::now(),
            shown,
        }
    }

    fn progress(&self, done: usize, passes: usize) {
        if !self.shown.get() && self.started.elapsed() >= Self::AFTER {
            self.bar
                .set_draw_target(indicatif::ProgressDrawTarget::stderr());
            self.shown.set(true);
        }
        self.bar.set_length(passes as u64);
        self.bar.set_position(done as u64);
    }

    fn clear(&self) {
        if !self.bar.is_finished() {
            self.bar.finish_and_clear();
        }
    }
}

/// A watch of the tokens (`tokens`, as a closure is) that draws the prefill's progress on
/// `bar` and clears it at the first token.
struct FillBarWatch<'a, F> {
    bar: Option<&'a FillBar>,
    tokens: F,
}

impl<F: FnMut(usize, u32) -> bool> canopy_runtime::Watch for FillBarWatch<'_, F> {
    fn token(&mut self, sample: usize, token: u32) -> bool {
        if let Some(bar) = self.bar {
            bar.clear();
        }
        (self.tokens)(sample, token)
    }

    fn context_progress(&mut self, done: usize, passes: usize) {
        if let Some(bar) = self.bar {
            bar.progress(done, passes);
        }
    }
}
