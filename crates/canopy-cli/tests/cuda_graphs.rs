//! Decode steps replayed from a recorded CUDA graph against the same steps run kernel by
//! kernel, on the tiny random Llamas of `tests/fixtures/tiny` with bf16 weights and KV.
//!
//! A replay runs the recorded kernels on the staged inputs of its own step, so it must give
//! the eager pass's logits bit for bit (no kernel of a decode step reduces with atomics):
//! every step's top two logits and every sample's tokens are compared exactly. The runs cross
//! several KV pages, which come into the leaves' reserved room: the replayed passes read
//! pages written into the page table after they were recorded. They decode one row, three
//! parallel samples (three rows sharing the prompt) and twelve (more rows than the GEMV
//! takes: the projections run on cuBLAS).
//!
//! Without a GPU (no driver, no device, no NVRTC) the test prints why and passes.

use canopy_comm::ThreadWorld;
use canopy_core::{DType, Method};
use canopy_cuda::{CudaBackend, CudaError};
use canopy_engine::MergeCollective;
use canopy_model::Model;
use canopy_runtime::{
    generate, DecodeStrategy, GenerateRequest, Generated, ModelLayers, SamplingParams,
};
use std::path::PathBuf;
use std::time::Duration;

const PAGE: u32 = 16;

fn gpu() -> Option<CudaBackend> {
    match CudaBackend::new(0) {
        Ok(b) => Some(b.with_paging(PAGE).expect("a valid page size")),
        Err(e @ (CudaError::NoDriver | CudaError::NoDevice(_) | CudaError::NoNvrtc)) => {
            eprintln!("cuda_graphs: skipped, no GPU to run on ({e})");
            None
        }
        Err(e) => panic!("creating the CUDA backend: {e}"),
    }
}

fn run(
    backend: &CudaBackend,
    layers: &ModelLayers<CudaBackend>,
    req: &GenerateRequest,
) -> Generated {
    ThreadWorld::run(1, Duration::from_secs(120), |comm| {
        generate(backend, layers, req, &comm, &mut |_, _| true)
    })
    .remove(0)
    .expect("the generation runs")
}

#[test]
fn replayed_decode_steps_equal_eager_ones() {
    let Some(backend) = gpu() else { return };
    for variant in ["gqa-hd64", "llama3-hd128", "tied-mha-hd64"] {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/tiny")
            .join(variant);
        let model = Model::load(&dir, DType::Bf16).expect("the fixture loads");
        let layers = ModelLayers::upload(&backend, &model.config, &model.weights, &mut |_| {})
            .expect("the weights upload");
        let vocab = model.config.vocab_size as u32;
        // 21 prompt tokens, then 60 decoded: the KV crosses four page boundaries.
        let prompt: Vec<u32> = (0..21).map(|i| (i * 37 + 5) % vocab).collect();
        for (samples, temperature) in [(1, 0.0), (3, 0.9), (12, 0.9)] {
            let mut req = GenerateRequest {
                prompt: prompt.clone(),
                max_tokens: 60,
                samples,
                sampling: SamplingParams {
                    temperature,
                    ..SamplingParams::default()
                },
                seed: 7,
                stop_tokens: Vec::new(),
                strategy: DecodeStrategy::Tree(MergeCollective::Allreduce2),
                method: Method::Auto,
                page_size: PAGE,
                kv_dtype: DType::Bf16,
                context_fill: canopy_runtime::ContextFill::Prefill,
                prefill_chunk: canopy_runtime::DEFAULT_PREFILL_CHUNK,
                graphs: false,
                logprobs: None,
            };
            let eager = run(&backend, &layers, &req);
            req.graphs = true;
            let replayed = run(&backend, &layers, &req);
            let case = format!("{variant}, {samples} samples");
            assert_eq!(eager.replayed_steps, 0, "{case}");
            // The first step plans and a later one records; the plan, the page table and the
            // recording then carry over every page boundary, so all but a few steps replay.
            assert!(
                replayed.replayed_steps >= 59 - 5,
                "{case}: only {} of 59 steps replayed",
                replayed.replayed_steps
            );
            assert_eq!(replayed.top_two.len(), eager.top_two.len(), "{case}");
            for (step, (g, e)) in replayed.top_two.iter().zip(&eager.top_two).enumerate() {
                assert_eq!(
                    (
                        g.token,
                        g.logit.to_bits(),
                        g.second_token,
                        g.second_logit.to_bits()
                    ),
                    (
                        e.token,
                        e.logit.to_bits(),
                        e.second_token,
                        e.second_logit.to_bits()
                    ),
                    "{case}: step {step}'s top two"
                );
            }
            assert_eq!(replayed.samples, eager.samples, "{case}");
        }
    }
}
