//! The runtime against transformers on the tiny random Llamas of `tests/fixtures/tiny` (GQA
//! with head dim 64, llama3-scaled RoPE with head dim 128 and tied embeddings, MHA) and of
//! `tests/fixtures/kquant` (a GGUF file in K-quants with a sentencepiece tokenizer): the prompt's last logits within 1e-4
//! relative and the greedy tokens identical — on one rank, on 2 to 4 ranks (threads) with the
//! tree merges and the ring, with uneven chunks and ranks that hold no prompt tokens — and `n`
//! parallel samples at temperature 0 all equal to the greedy text. Models of head dims no GPU
//! kernel is built for, with random weights, are held to one rank's tokens; an empty prompt to
//! its error.

use canopy_comm::ThreadWorld;
use canopy_core::{DType, Method};
use canopy_engine::{CpuBackend, MergeCollective};
use canopy_model::Model;
use canopy_runtime::{
    generate, DecodeStrategy, GenerateRequest, Generated, ModelLayers, RandomWeights, RuntimeError,
    SamplingParams,
};
use serde_json::Value;
use std::path::PathBuf;
use std::time::Duration;

const VARIANTS: [&str; 3] = ["gqa-hd64", "llama3-hd128", "tied-mha-hd64"];

fn fixture(variant: &str) -> (Model, Value) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/tiny")
        .join(variant);
    let model = Model::load(&dir, DType::F32).expect("the fixture loads");
    let text = std::fs::read_to_string(dir.join("reference.json")).expect("its reference");
    (model, serde_json::from_str(&text).expect("JSON"))
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

fn request(prompt: Vec<u32>, samples: usize, strategy: DecodeStrategy) -> GenerateRequest {
    GenerateRequest {
        prompt,
        max_tokens: 32,
        samples,
        sampling: SamplingParams::default(),
        seed: 0,
        stop_tokens: Vec::new(),
        strategy,
        method: Method::Auto,
        page_size: 16,
        kv_dtype: DType::F32,
        context_fill: canopy_runtime::ContextFill::Prefill,
        prefill_chunk: canopy_runtime::DEFAULT_PREFILL_CHUNK,
        graphs: true,
        logprobs: None,
    }
}

fn layers(model: &Model) -> ModelLayers<CpuBackend> {
    ModelLayers::upload(&CpuBackend, &model.config, &model.weights, &mut |_| {})
        .expect("the weights upload")
}

/// `req` on `ranks` threads; every rank must end with the same tokens.
fn run(layers: &ModelLayers<CpuBackend>, req: &GenerateRequest, ranks: usize) -> Generated {
    let outs = ThreadWorld::run(ranks, Duration::from_secs(120), |comm| {
        generate(&CpuBackend, layers, req, &comm, &mut |_, _| true)
    });
    let outs: Vec<Generated> = outs.into_iter().map(|r| r.expect("the rank ran")).collect();
    for o in &outs[1..] {
        assert_eq!(o.samples, outs[0].samples, "ranks agree");
    }
    outs.into_iter().next().unwrap()
}

fn assert_close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-4 * w.abs().max(1.0),
            "{what}: logit {i}: {g} vs {w}"
        );
    }
}

#[test]
fn one_rank_matches_transformers() {
    for variant in VARIANTS {
        let (model, reference) = fixture(variant);
        let layers = layers(&model);
        for p in reference["prompts"].as_array().unwrap() {
            let req = request(
                ids(&p["token_ids"]),
                1,
                DecodeStrategy::Tree(MergeCollective::Allreduce2),
            );
            let out = run(&layers, &req, 1);
            let what = format!("{variant}, prompt of {}", p["length"]);
            assert_close(&out.first_logits, &floats(&p["logits_last"]), &what);
            assert_eq!(out.samples[0], ids(&p["greedy_tokens"]), "{what}");
        }
    }
}

/// A GGUF file as llama.cpp's K-quant mixes store a Llama 2-style model (weights in Q2_K to
/// Q6_K and Q8_0, a sentencepiece tokenizer): its logits and greedy tokens as transformers
/// computes them from the same file, on one rank and on three.
#[test]
fn a_k_quant_gguf_matches_transformers() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/kquant");
    let model = Model::load(&dir.join("model.gguf"), DType::F32).expect("the fixture loads");
    let text = std::fs::read_to_string(dir.join("reference.json")).expect("its reference");
    let reference: Value = serde_json::from_str(&text).expect("JSON");
    let layers = layers(&model);
    for ranks in [1, 3] {
        for p in reference["prompts"].as_array().unwrap() {
            let mut req = request(
                ids(&p["token_ids"]),
                1,
                DecodeStrategy::Tree(MergeCollective::Allreduce2),
            );
            req.max_tokens = ids(&p["greedy_tokens"]).len();
            let out = run(&layers, &req, ranks);
            let what = format!("K-quant GGUF on {ranks} ranks, prompt of {}", p["length"]);
            assert_close(&out.first_logits, &floats(&p["logits_last"]), &what);
            assert_eq!(out.samples[0], ids(&p["greedy_tokens"]), "{what}");
        }
    }
}

#[test]
fn sharded_equals_unsharded_for_every_strategy() {
    let (model, reference) = fixture("llama3-hd128");
    let layers = layers(&model);
    let prompts = reference["prompts"].as_array().unwrap();
    let strategies = [
        DecodeStrategy::Tree(MergeCollective::Allreduce3),
        DecodeStrategy::Tree(MergeCollective::Allreduce2),
        DecodeStrategy::Tree(MergeCollective::Allgather),
        DecodeStrategy::Tree(MergeCollective::Hierarchical),
        DecodeStrategy::Tree(MergeCollective::Auto),
        DecodeStrategy::Ring,
    ];
    // 100 tokens in pages of 16 split unevenly over 3 ranks; 7 and 1 token leave ranks with
    // no prompt at all, whose shards are empty when decoding starts.
    for p in prompts
        .iter()
        .filter(|p| [1, 7, 100].contains(&p["length"].as_u64().unwrap()))
    {
        let want = ids(&p["greedy_tokens"]);
        for ranks in 2..=4 {
            for strategy in strategies {
                let out = run(&layers, &request(ids(&p["token_ids"]), 1, strategy), ranks);
                let what = format!("prompt of {}, {ranks} ranks, {strategy:?}", p["length"]);
                assert_close(&out.first_logits, &floats(&p["logits_last"]), &what);
                assert_eq!(out.samples[0], want, "{what}");
            }
        }
    }
}

/// A prompt prefilled in pieces (each rank's chunk of a piece a page or a few, the last piece
/// ragged, some ranks idle in it) gives transformers' logits and greedy text, and reports
/// every layer of every piece once.
#[test]
fn a_prompt_prefilled_in_pieces_matches_transformers() {
    let (model, reference) = fixture("gqa-hd64");
    let layers = layers(&model);
    let layer_count = model.config.num_hidden_layers;
    let p = reference["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["length"].as_u64() == Some(100))
        .expect("a prompt of 100 tokens");
    for ranks in 1..=3 {
        for chunk in [4, 12, 33] {
            let req = GenerateRequest {
                page_size: 4,
                prefill_chunk: chunk,
                ..request(
                    ids(&p["token_ids"]),
                    1,
                    DecodeStrategy::Tree(MergeCollective::Allreduce2),
                )
            };
            let outs = ThreadWorld::run(ranks, Duration::from_secs(120), |comm| {
                let mut watch = Timing::default();
                let out = generate(&CpuBackend, &layers, &req, &comm, &mut watch)?;
                Ok::<_, canopy_runtime::RuntimeError>((out, watch.layers_done))
            });
            let what = format!("{ranks} ranks, chunks of {chunk}");
            let piece = chunk.div_ceil(4) * 4 * ranks;
            let passes = 100usize.div_ceil(piece) * layer_count;
            for out in outs {
                let (out, done) = out.expect("the rank ran");
                assert_close(&out.first_logits, &floats(&p["logits_last"]), &what);
                assert_eq!(out.samples[0], ids(&p["greedy_tokens"]), "{what}");
                let want: Vec<_> = (1..=passes).map(|d| (d, passes)).collect();
                assert_eq!(done, want, "{what}: every pass is reported once");
            }
        }
    }
}

#[test]
fn parallel_samples_at_temperature_zero_are_the_greedy_text() {
    let (model, reference) = fixture("gqa-hd64");
    let layers = layers(&model);
    let p = &reference["prompts"].as_array().unwrap()[2];
    let want = ids(&p["greedy_tokens"]);
    for ranks in [1, 2] {
        let out = run(
            &layers,
            &request(
                ids(&p["token_ids"]),
                4,
                DecodeStrategy::Tree(MergeCollective::Allreduce2),
            ),
            ranks,
        );
        for s in &out.samples {
            assert_eq!(s, &want, "{ranks} ranks");
        }
    }
}

/// Each seeded sample draws what its seed draws alone, on one rank or two, whether its
/// steps read narrowed rows or whole ones (log-probabilities asked for): cut by `top_k`, and
/// over the whole vocabulary, whose draws read their rows' softmax totals and, where they land
/// past the narrowed rows, the rows whole.
#[test]
fn each_seeded_sample_equals_its_seed_decoded_alone() {
    let (model, reference) = fixture("tied-mha-hd64");
    let layers = layers(&model);
    let prompt = ids(&reference["prompts"].as_array().unwrap()[1]["token_ids"]);
    let strategy = DecodeStrategy::Tree(MergeCollective::Allreduce2);
    for (temperature, top_k, top_p) in [(0.9, 40, 0.95), (1.0, 0, 1.0), (1.5, 0, 0.9)] {
        let sampling = SamplingParams {
            temperature,
            top_k,
            top_p,
            ..SamplingParams::default()
        };
        let together = run(
            &layers,
            &GenerateRequest {
                sampling,
                seed: 11,
                ..request(prompt.clone(), 4, strategy)
            },
            2,
        );
        for (i, s) in together.samples.iter().enumerate() {
            for logprobs in [None, Some(1)] {
                let alone = run(
                    &layers,
                    &GenerateRequest {
                        sampling,
                        seed: 11 + i as u64,
                        logprobs,
                        ..request(prompt.clone(), 1, strategy)
                    },
                    1,
                );
                assert_eq!(
                    s, &alone.samples[0],
                    "{sampling:?}, sample {i}, {logprobs:?}"
                );
            }
        }
        assert!(
            together.samples.windows(2).any(|w| w[0] != w[1]),
            "seeds differ"
        );
    }
}

/// A watch that follows the fill and times the merges.
#[derive(Default)]
struct Timing {
    layers_done: Vec<(usize, usize)>,
}

impl canopy_runtime::Watch for Timing {
    fn token(&mut self, _: usize, _: u32) -> bool {
        true
    }
    fn context_progress(&mut self, done: usize, layers: usize) {
        self.layers_done.push((done, layers));
    }
    fn time_merges(&self) -> bool {
        true
    }
}

#[test]
fn timed_merges_change_no_token_and_time_every_second_step() {
    let (model, reference) = fixture("gqa-hd64");
    let layers = layers(&model);
    let p = &reference["prompts"].as_array().unwrap()[2];
    let layer_count = model.config.num_hidden_layers;
    for strategy in [
        DecodeStrategy::Tree(MergeCollective::Allreduce3),
        DecodeStrategy::Ring,
    ] {
        let req = request(ids(&p["token_ids"]), 1, strategy);
        let outs = ThreadWorld::run(2, Duration::from_secs(120), |comm| {
            let mut watch = Timing::default();
            let out = generate(&CpuBackend, &layers, &req, &comm, &mut watch)?;
            Ok::<_, canopy_runtime::RuntimeError>((out, watch.layers_done))
        });
        for out in outs {
            let (out, done) = out.expect("the rank ran");
            assert_eq!(out.samples[0], ids(&p["greedy_tokens"]), "{strategy:?}");
            let want: Vec<_> = (1..=layer_count).map(|d| (d, layer_count)).collect();
            assert_eq!(done, want, "every layer of the prefill is reported once");
            assert_eq!(out.merge_s.len(), out.step_s.len());
            for (i, m) in out.merge_s.iter().enumerate() {
                let timed = i % 2 == 1 && strategy != DecodeStrategy::Ring;
                assert_eq!(m.is_some(), timed, "step {i}, {strategy:?}");
                if let Some(s) = m {
                    assert!(
                        (0.0..=out.step_s[i]).contains(s),
                        "step {i}: {s} s in merges"
                    );
                }
            }
            let ttft = out.first_token_s.expect("a token was drawn");
            assert!(ttft >= out.prefill_s, "{ttft} < {}", out.prefill_s);
        }
    }
}

/// An empty prompt is refused with the message that says what to give, both when the request
/// is priced (which the CLI does first) and when it is run.
#[test]
fn an_empty_prompt_is_refused_before_anything_runs() {
    let (model, _) = fixture("gqa-hd64");
    let req = request(Vec::new(), 1, DecodeStrategy::Tree(MergeCollective::Auto));
    let priced = req.needs(&model.config, DType::F32, 1, 1);
    assert!(
        matches!(priced, Err(RuntimeError::EmptyPrompt)),
        "{priced:?}"
    );
    let layers = layers(&model);
    let outs = ThreadWorld::run(2, Duration::from_secs(60), |comm| {
        generate(&CpuBackend, &layers, &req, &comm, &mut |_, _| true)
    });
    for out in outs {
        let err = out.expect_err("an empty prompt is refused");
        assert!(matches!(err, RuntimeError::EmptyPrompt), "{err}");
    }
}

/// Requests past the model's positions, or past the 32-bit positions and pages a rank
/// addresses, are refused by their sizes when priced, however large the numbers: not by
/// the memory they would take, nor after a wrapped count was allocated.
#[test]
fn oversized_requests_are_refused_by_their_sizes() {
    let (model, _) = fixture("gqa-hd64");
    let capacity = model.config.max_position_embeddings;
    for max_tokens in [capacity, 1 << 20, usize::MAX] {
        let mut req = request(vec![1, 2, 3], 1, DecodeStrategy::Ring);
        req.max_tokens = max_tokens;
        let priced = req.needs(&model.config, DType::F32, 1, 1);
        assert!(
            matches!(priced, Err(RuntimeError::TooLong { capacity: c, .. }) if c == capacity),
            "{max_tokens}: {priced:?}"
        );
    }
    let mut config = model.config.clone();
    config.max_position_embeddings = usize::MAX;
    for (samples, max_tokens) in [(1 << 32, 2), (1 << 20, 1 << 20), (1, u32::MAX as usize)] {
        let mut req = request(vec![1, 2, 3], samples, DecodeStrategy::Ring);
        req.max_tokens = max_tokens;
        let priced = req.needs(&config, DType::F32, 1, 1);
        assert!(
            matches!(priced, Err(RuntimeError::TooManyTokens { .. })),
            "{samples} x {max_tokens}: {priced:?}"
        );
    }
}

/// Head dims no GPU kernel is built for (the CPU backend runs any even one): a random
/// model's first logits and greedy tokens on 3 ranks with the tree and on 2 with the ring
/// equal one rank's.
#[test]
fn head_dims_without_gpu_kernels_shard_like_one_rank() {
    for head_dim in [8, 80] {
        // The GQA fixture's shape with other heads (its weights do not fit them).
        let mut config = fixture("gqa-hd64").0.config;
        config.head_dim = head_dim;
        let weights = RandomWeights::new(&config, DType::F32, 5);
        let layers = ModelLayers::upload(&CpuBackend, &config, &weights, &mut |_| {})
            .expect("the weights upload");
        let prompt: Vec<u32> = (0..37).map(|i| (i * 7 + 3) % 97).collect();
        let tree = DecodeStrategy::Tree(MergeCollective::Auto);
        let one = run(&layers, &request(prompt.clone(), 1, tree), 1);
        for (ranks, strategy) in [(3, tree), (2, DecodeStrategy::Ring)] {
            let out = run(&layers, &request(prompt.clone(), 1, strategy), ranks);
            let what = format!("head dim {head_dim}, {ranks} ranks, {strategy:?}");
            assert_close(&out.first_logits, &one.first_logits, &what);
            assert_eq!(out.samples[0], one.samples[0], "{what}");
        }
    }
}
