//! `canopy bench decode`: a model's decode step timed at long contexts, tree against ring,
//! beside the floor the hardware allows.
//!
//! Every run is one generation on `P` rank threads: the context's KV (prefilled, or random
//! with `--context-fill random`), then `--decode` tokens. A step's time is from one token to
//! the next on rank 0; the floor of a step is the bytes one rank must read (every weight,
//! its share of the KV) at the device's copy bandwidth, measured in the same run.

use crate::bench::{at_least_one, resolve_backend, BackendChoice, BackendKind, World};
use crate::generate_cmd::DecodeChoice;
use crate::ranks::{Placed, RankThreads, WeightSource};
use crate::table::Table;
use anyhow::{bail, Context, Result};
use canopy_core::{DType, Method};
use canopy_cuda::CudaBackend;
use canopy_engine::{CpuBackend, MergeCollective};
use canopy_model::{LlamaConfig, Model};
use canopy_runtime::{ContextFill, DecodeStrategy, GenerateRequest, SamplingParams};
use clap::{Args, ValueEnum};
use serde::Serialize;
use std::path::PathBuf;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum FillChoice {
    /// Run the context through the model first (sequence-parallel prefill).
    Prefill,
    /// Random keys and values stand in for the context: decode timing at contexts whose
    /// prefill would not fit a run. The tokens generated mean nothing.
    Random,
}

#[derive(Args)]
pub struct DecodeArgs {
    /// A Hugging Face model directory or a `.gguf` file.
    #[arg(long, required_unless_present = "arch", conflicts_with = "arch")]
    model: Option<PathBuf>,
    /// A model shape without weights: llama-3.1-8b, llama-3.2-1b or smollm2-135m (needs
    /// --random-weights).
    #[arg(long, requires = "random_weights")]
    arch: Option<String>,
    /// Random weights of the model's shape instead of its own.
    #[arg(long)]
    random_weights: bool,
    /// Context lengths in tokens (K = 1024, M = 1024²), comma-separated.
    #[arg(long, value_delimiter = ',', value_parser = parse_tokens, default_value = "8K")]
    context: Vec<usize>,
    /// Tokens decoded after the context.
    #[arg(long, default_value_t = 10, value_parser = at_least_one)]
    decode: usize,
    /// Rank counts, comma-separated (threads of this process; ranks beyond the GPUs share
    /// them).
    #[arg(long, value_delimiter = ',', default_value = "1", value_parser = at_least_one)]
    ranks: Vec<usize>,
    /// Strategies, comma-separated.
    #[arg(long, value_delimiter = ',', value_enum, default_value = "tree")]
    strategy: Vec<DecodeChoice>,
    /// The tree's merge: allreduce3, allreduce2, allgather, hierarchical or auto.
    #[arg(long, default_value = "auto")]
    collective: MergeCollective,
    #[arg(long, value_enum, default_value = "prefill")]
    context_fill: FillChoice,
    #[arg(long, value_enum, default_value = "auto")]
    backend: BackendChoice,
    /// The dtype of the weights and the KV cache [default: f32 on the CPU, bf16 on a GPU].
    #[arg(long)]
    dtype: Option<DType>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Print one JSON document instead of the table.
    #[arg(long)]
    json: bool,
}

/// `8192`, `8K`, `1M`: a token count.
fn parse_tokens(s: &str) -> Result<usize, String> {
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

/// One measured configuration.
#[derive(Serialize)]
struct Row {
    context: usize,
    ranks: usize,
    strategy: String,
    context_fill: &'static str,
    /// Seconds to fill the context (prefill or random fill).
    fill_s: f64,
    decode_ms_per_token: f64,
    decode_tokens_per_s: f64,
    /// The step's floor on one rank: (weights + the rank's KV) / copy bandwidth.
    floor_ms: Option<f64>,
    vs_floor: Option<f64>,
}

#[derive(Serialize)]
struct Report {
    model: String,
    backend: String,
    dtype: String,
    weight_bytes: u64,
    copy_bandwidth_gb_s: Option<f64>,
    rows: Vec<Row>,
}

pub fn run(a: DecodeArgs) -> Result<()> {
    let kind = resolve_backend(a.backend)?;
    let dtype = a.dtype.unwrap_or(match kind {
        BackendKind::Cpu => DType::F32,
        BackendKind::Cuda => DType::Bf16,
    });
    let (name, config, source) = match (&a.arch, &a.model) {
        (Some(arch), _) => (
            arch.clone(),
            canopy_model::presets::preset(arch)?,
            WeightSource::Random {
                dtype,
                seed: a.seed,
            },
        ),
        (None, Some(path)) => {
            let model = Model::load(path, dtype)
                .with_context(|| format!("loading the model at {}", path.display()))?;
            let source = if a.random_weights {
                WeightSource::Random {
                    dtype,
                    seed: a.seed,
                }
            } else {
                WeightSource::Loaded(model.weights)
            };
            (path.display().to_string(), model.config, source)
        }
        (None, None) => bail!("give --model or --arch"),
    };
    let longest = a.context.iter().max().copied().unwrap_or(1);
    if longest + a.decode > config.max_position_embeddings {
        bail!(
            "a context of {longest} tokens plus {} decoded exceeds the model's capacity of {} tokens; use shorter --context",
            a.decode,
            config.max_position_embeddings
        );
    }
    let weight_bytes = config_weight_bytes(&config, dtype);
    let (rows, bandwidth) = match kind {
        BackendKind::Cpu => {
            let cpu = |_| Ok(CpuBackend);
            (measure(&a, &config, source, dtype, &cpu, 1, None)?, None)
        }
        BackendKind::Cuda => {
            let gpus = canopy_cuda::probe::device_count()?;
            let backend = |ordinal: usize| -> Result<CudaBackend> {
                Ok(CudaBackend::new(ordinal)?.with_paging(crate::generate_cmd::PAGE_SIZE)?)
            };
            let bandwidth = canopy_cuda::bench::measure_copy_bandwidth(&backend(0)?)?;
            let rows = measure(&a, &config, source, dtype, &backend, gpus, Some(bandwidth))?;
            (rows, Some(bandwidth))
        }
    };
    let report = Report {
        model: name,
        backend: kind.to_string(),
        dtype: dtype.to_string(),
        weight_bytes,
        copy_bandwidth_gb_s: bandwidth.map(|b| b / 1e9),
        rows,
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    print_table(&report);
    Ok(())
}

/// Every (context, ranks, strategy) configuration on backends made by `backend`, the
/// floor priced at `bandwidth` (bytes/s) where it is known.
fn measure<B: RankThreads>(
    a: &DecodeArgs,
    config: &LlamaConfig,
    source: WeightSource,
    dtype: DType,
    backend: &dyn Fn(usize) -> Result<B>,
    devices: usize,
    bandwidth: Option<f64>,
) -> Result<Vec<Row>> {
    let world = World::Threads;
    let most = a.ranks.iter().max().copied().unwrap_or(1);
    let request = |context: usize, strategy: DecodeStrategy| GenerateRequest {
        // Token ids are irrelevant to a timing; any in the vocabulary do.
        prompt: (0..context as u32)
            .map(|i| i % config.vocab_size as u32)
            .collect(),
        max_tokens: a.decode,
        samples: 1,
        sampling: SamplingParams::default(),
        seed: a.seed,
        stop_tokens: Vec::new(),
        strategy,
        method: Method::Auto,
        page_size: crate::generate_cmd::PAGE_SIZE,
        kv_dtype: dtype,
        context_fill: match a.context_fill {
            FillChoice::Prefill => ContextFill::Prefill,
            FillChoice::Random => ContextFill::Random { seed: a.seed },
        },
    };
    let weight_bytes = config_weight_bytes(config, dtype);
    let longest = a.context.iter().max().copied().unwrap_or(1);
    let sizing = request(longest, DecodeStrategy::Ring);
    let needs = |here: usize| Ok(sizing.needs(config, dtype, weight_bytes, most, here)?);
    let placed = Placed::new(&world, most, devices, backend, config, source, &needs)?;
    let mut rows = Vec::new();
    for &context in &a.context {
        for &ranks in &a.ranks {
            for &choice in &a.strategy {
                let strategy = match choice {
                    DecodeChoice::Tree => DecodeStrategy::Tree(a.collective),
                    DecodeChoice::Ring => DecodeStrategy::Ring,
                };
                let req = request(context, strategy);
                let out = placed
                    .run(&world, ranks, &|b, l, comm| {
                        comm.generate(b, l, &req, &mut |_, _| true)
                    })?
                    .expect("threads report rank 0");
                let mut steps = out.step_s.clone();
                steps.sort_by(f64::total_cmp);
                let median_ms = steps.get(steps.len() / 2).copied().unwrap_or(f64::NAN) * 1e3;
                // K and V of the rank's share of the context, every layer.
                let kv_bytes = (context.div_ceil(ranks)
                    * config.num_hidden_layers
                    * 2
                    * config.attn_shape().kv_token_bytes(dtype))
                    as u64;
                let floor_ms = bandwidth.map(|bw| (weight_bytes + kv_bytes) as f64 / bw * 1e3);
                rows.push(Row {
                    context,
                    ranks,
                    strategy: match strategy {
                        DecodeStrategy::Tree(c) => format!("tree/{}", c.name()),
                        DecodeStrategy::Ring => "ring".into(),
                    },
                    context_fill: match a.context_fill {
                        FillChoice::Prefill => "prefill",
                        FillChoice::Random => "random",
                    },
                    fill_s: out.prefill_s,
                    decode_ms_per_token: median_ms,
                    decode_tokens_per_s: 1e3 / median_ms,
                    floor_ms,
                    vs_floor: floor_ms.map(|f| median_ms / f),
                });
            }
        }
    }
    Ok(rows)
}

/// Bytes of every weight of `config` in `dtype`: what each decode step reads once per rank.
fn config_weight_bytes(c: &LlamaConfig, dtype: DType) -> u64 {
    let (h, f, v) = (c.hidden_size, c.intermediate_size, c.vocab_size);
    let q = c.num_attention_heads * c.head_dim;
    let kv = c.num_key_value_heads * c.head_dim;
    let layer = 2 * h + h * q + 2 * h * kv + q * h + 3 * h * f;
    let head = if c.tie_word_embeddings { 0 } else { v * h };
    ((c.num_hidden_layers * layer + v * h + h + head) * dtype.size_bytes()) as u64
}

fn print_table(r: &Report) {
    let mut t = Table::new(&[
        "context", "ranks", "strategy", "fill", "fill s", "ms/token", "tokens/s", "floor ms",
        "x floor",
    ]);
    for row in &r.rows {
        let opt = |x: Option<f64>, f: &dyn Fn(f64) -> String| x.map_or("-".into(), f);
        t.row(vec![
            row.context.to_string(),
            row.ranks.to_string(),
            row.strategy.clone(),
            row.context_fill.to_string(),
            format!("{:.2}", row.fill_s),
            format!("{:.2}", row.decode_ms_per_token),
            format!("{:.1}", row.decode_tokens_per_s),
            opt(row.floor_ms, &|x| format!("{x:.2}")),
            opt(row.vs_floor, &|x| format!("{x:.2}")),
        ]);
    }
    println!("{}", t.render());
    println!(
        "{} on {} ({}), weights {}{}",
        r.model,
        r.backend,
        r.dtype,
        crate::table::bytes(r.weight_bytes),
        r.copy_bandwidth_gb_s
            .map_or(String::new(), |b| format!("; copy bandwidth {b:.0} GB/s")),
    );
    if r.rows.iter().any(|row| row.context_fill == "random") {
        println!("the context's KV was filled at random, not prefilled: the tokens mean nothing");
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

    #[test]
    fn an_8b_shape_weighs_what_llama_3_1_8b_does() {
        let c = canopy_model::presets::preset("llama-3.1-8b").unwrap();
        let gb = config_weight_bytes(&c, DType::Bf16) as f64 / 1e9;
        assert!((gb - 16.06).abs() < 0.01, "{gb}");
    }
}
