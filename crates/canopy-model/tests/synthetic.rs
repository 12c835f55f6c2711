//! Tiny models written by the tests themselves: a GGUF file (with llama.cpp's Q/K row
//! permutation and F32, F16, Q8_0, Q4_0 and Q4_1 tensors) and the same model as a Hugging
//! Face safetensors directory, which must load to identical weights; every quantized type
//! read as the `gguf` package reads it (`tests/fixtures/quant/`); and every kind of bad input
//! the loader must refuse with a clear error instead of a panic.

mod gguf_writer;

use std::path::{Path, PathBuf};

use canopy_core::{DType, TypedVec};
use canopy_model::{
    GgmlType, GgufFile, HostTensor, LayerPart, Model, ModelError, WeightId, WeightSource,
};
use gguf_writer::{expected_dequantized, GgufWriter, Meta};
use safetensors::tensor::TensorView;
use safetensors::Dtype;

const HIDDEN: usize = 64;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = 16;
const INTERMEDIATE: usize = 96;
const LAYERS: usize = 2;

/// Byte-level BPE vocabulary: three control tokens, a few letters, space (`Ġ`) and newline
/// (`Ċ`) in GPT-2's byte-to-unicode spelling, and merged tokens.
const TOKENS: [&str; 16] = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "a",
    "b",
    "h",
    "i",
    "Ġ",
    "Ċ",
    "ab",
    "hi",
    "Ġhi",
    "Ġab",
    "o",
    "Ġa",
    "ho",
];
const MERGES: [&str; 6] = ["a b", "h i", "Ġ hi", "Ġ a", "Ġa b", "h o"];
const VOCAB: usize = TOKENS.len();

/// Deterministic values in about [-1, 1], different for every seed and index.
fn values(seed: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| {
            ((i * 7919 + seed * 104_729) as f32 * 0.618_034).sin() * (1.0 + (seed % 3) as f32 * 0.5)
        })
        .collect()
}

/// llama.cpp's `permute`: rows reshaped to `[n_head, 2, head_dim / 2]`, axes 1 and 2 swapped.
fn llama_cpp_permute(values: &[f32], rows: usize, n_head: usize) -> Vec<f32> {
    let cols = values.len() / rows;
    let head_dim = rows / n_head;
    let mut out = Vec::with_capacity(values.len());
    for head in 0..n_head {
        for j in 0..head_dim / 2 {
            for which_half in 0..2 {
                let row = head * head_dim + which_half * head_dim / 2 + j;
                out.extend(&values[row * cols..(row + 1) * cols]);
            }
        }
    }
    out
}

// ---------------------------------------------------------------------------------------
// The tiny model, as GGUF and as a Hugging Face directory.

/// One tensor of the tiny model: GGUF name, HF name, row-major shape, storage type in GGUF.
struct Spec {
    gguf: String,
    hf: String,
    shape: Vec<usize>,
    ggml_type: GgmlType,
    /// Q or K: the head count llama.cpp permutes its rows with.
    permute_heads: Option<usize>,
}

fn specs(tied: bool) -> Vec<Spec> {
    let spec = |gguf: &str, hf: &str, shape: &[usize], ggml_type, permute_heads| Spec {
        gguf: gguf.into(),
        hf: hf.into(),
        shape: shape.to_vec(),
        ggml_type,
        permute_heads,
    };
    let mut out = vec![spec(
        "token_embd.weight",
        "model.embed_tokens.weight",
        &[VOCAB, HIDDEN],
        GgmlType::Q8_0,
        None,
    )];
    for i in 0..LAYERS {
        let (b, l) = (format!("blk.{i}"), format!("model.layers.{i}"));
        out.extend([
            spec(
                &format!("{b}.attn_norm.weight"),
                &format!("{l}.input_layernorm.weight"),
                &[HIDDEN],
                GgmlType::F32,
                None,
            ),
            spec(
                &format!("{b}.attn_q.weight"),
                &format!("{l}.self_attn.q_proj.weight"),
                &[HEADS * HEAD_DIM, HIDDEN],
                GgmlType::F32,
                Some(HEADS),
            ),
            spec(
                &format!("{b}.attn_k.weight"),
                &format!("{l}.self_attn.k_proj.weight"),
                &[KV_HEADS * HEAD_DIM, HIDDEN],
                GgmlType::F16,
                Some(KV_HEADS),
            ),
            spec(
                &format!("{b}.attn_v.weight"),
                &format!("{l}.self_attn.v_proj.weight"),
                &[KV_HEADS * HEAD_DIM, HIDDEN],
                GgmlType::Q4_0,
                None,
            ),
            spec(
                &format!("{b}.attn_output.weight"),
                &format!("{l}.self_attn.o_proj.weight"),
                &[HIDDEN, HEADS * HEAD_DIM],
                GgmlType::Q4_1,
                None,
            ),
            spec(
                &format!("{b}.ffn_norm.weight"),
                &format!("{l}.post_attention_layernorm.weight"),
                &[HIDDEN],
                GgmlType::F32,
                None,
            ),
            spec(
                &format!("{b}.ffn_gate.weight"),
                &format!("{l}.mlp.gate_proj.weight"),
                &[INTERMEDIATE, HIDDEN],
                GgmlType::Q4_1,
                None,
            ),
            spec(
                &format!("{b}.ffn_up.weight"),
                &format!("{l}.mlp.up_proj.weight"),
                &[INTERMEDIATE, HIDDEN],
                GgmlType::Q8_0,
                None,
            ),
            spec(
                &format!("{b}.ffn_down.weight"),
                &format!("{l}.mlp.down_proj.weight"),
                &[HIDDEN, INTERMEDIATE],
                GgmlType::Q4_0,
                None,
            ),
        ]);
    }
    out.push(spec(
        "output_norm.weight",
        "model.norm.weight",
        &[HIDDEN],
        GgmlType::F32,
        None,
    ));
    if !tied {
        out.push(spec(
            "output.weight",
            "lm_head.weight",
            &[VOCAB, HIDDEN],
            GgmlType::F16,
            None,
        ));
    }
    out
}

fn llama_gguf(tied: bool) -> GgufWriter {
    let mut w = GgufWriter::default();
    w.meta("general.architecture", Meta::Str("llama".into()));
    for (key, value) in [
        ("llama.block_count", LAYERS),
        ("llama.context_length", 256),
        ("llama.embedding_length", HIDDEN),
        ("llama.feed_forward_length", INTERMEDIATE),
        ("llama.attention.head_count", HEADS),
        ("llama.attention.head_count_kv", KV_HEADS),
        ("llama.rope.dimension_count", HEAD_DIM),
        ("tokenizer.ggml.bos_token_id", 1),
        ("tokenizer.ggml.eos_token_id", 2),
    ] {
        w.meta(key, Meta::U32(value as u32));
    }
    w.meta("llama.attention.layer_norm_rms_epsilon", Meta::F32(1e-5));
    w.meta("llama.rope.freq_base", Meta::F32(10000.0));
    w.meta("tokenizer.ggml.model", Meta::Str("gpt2".into()));
    w.meta("tokenizer.ggml.pre", Meta::Str("smollm".into()));
    w.meta("tokenizer.ggml.add_bos_token", Meta::Bool(false));
    w.meta(
        "tokenizer.ggml.tokens",
        Meta::Strs(TOKENS.iter().map(|t| t.to_string()).collect()),
    );
    w.meta(
        "tokenizer.ggml.merges",
        Meta::Strs(MERGES.iter().map(|t| t.to_string()).collect()),
    );
    w.meta(
        "tokenizer.ggml.token_type",
        Meta::I32s((0..VOCAB).map(|i| if i < 3 { 3 } else { 1 }).collect()),
    );
    for (seed, spec) in specs(tied).iter().enumerate() {
        let len = spec.shape.iter().product();
        let hf_values = values(seed, len);
        let stored = match spec.permute_heads {
            Some(n_head) => llama_cpp_permute(&hf_values, spec.shape[0], n_head),
            None => hf_values,
        };
        w.tensor(&spec.gguf, &spec.shape, spec.ggml_type, &stored);
    }
    w
}

/// The HF directory of the same model: each tensor holds what its GGUF twin dequantizes
/// to, in HF row order, as F32 safetensors.
fn write_hf_dir(dir: &Path, tied: bool) {
    let specs = specs(tied);
    let data: Vec<(String, Vec<usize>, Vec<u8>)> = specs
        .iter()
        .enumerate()
        .map(|(seed, spec)| {
            let len = spec.shape.iter().product();
            // Blocks lie within rows (every row is a multiple of 32 long), so decoding the
            // HF-ordered rows gives the same values as decoding the permuted ones.
            let decoded = expected_dequantized(spec.ggml_type, &values(seed, len));
            let bytes = decoded.iter().flat_map(|v| v.to_le_bytes()).collect();
            (spec.hf.clone(), spec.shape.clone(), bytes)
        })
        .collect();
    let views: Vec<(String, TensorView)> = data
        .iter()
        .map(|(name, shape, bytes)| {
            (
                name.clone(),
                TensorView::new(Dtype::F32, shape.clone(), bytes).unwrap(),
            )
        })
        .collect();
    std::fs::write(
        dir.join("model.safetensors"),
        safetensors::serialize(views, None).unwrap(),
    )
    .unwrap();
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 256,
        "tie_word_embeddings": tied, "bos_token_id": 1, "eos_token_id": 2,
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    std::fs::write(
        dir.join("generation_config.json"),
        r#"{"eos_token_id": [2, 0], "temperature": 0.6, "top_p": 0.9}"#,
    )
    .unwrap();
}

struct Fixture {
    _dir: tempfile::TempDir,
    gguf: PathBuf,
    hf: PathBuf,
}

fn fixture(tied: bool) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let gguf = dir.path().join("tiny.gguf");
    llama_gguf(tied).write(&gguf);
    let hf = dir.path().join("hf");
    std::fs::create_dir(&hf).unwrap();
    write_hf_dir(&hf, tied);
    // The HF directory's tokenizer is the one built from the GGUF metadata, saved.
    let tokenizer = Model::load(&gguf, DType::F32).unwrap().tokenizer;
    tokenizer
        .inner()
        .save(hf.join("tokenizer.json"), false)
        .unwrap();
    Fixture {
        _dir: dir,
        gguf,
        hf,
    }
}

// ---------------------------------------------------------------------------------------
// Tests.

#[test]
fn quantized_tensors_dequantize_to_ggml_reference_values() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("q.gguf");
    let mut w = GgufWriter::default();
    let types = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
    ];
    for (i, ggml_type) in types.iter().enumerate() {
        w.tensor(&format!("t{i}"), &[3, 64], *ggml_type, &values(i, 3 * 64));
    }
    w.write(&path);
    let gguf = GgufFile::open(&path).unwrap();
    for (i, ggml_type) in types.iter().enumerate() {
        let original = values(i, 3 * 64);
        let tensor = gguf.read_tensor(&format!("t{i}"), DType::F32).unwrap();
        assert_eq!(tensor.shape, [3, 64]);
        let got = tensor.data.to_f32_vec();
        assert_eq!(
            got,
            expected_dequantized(*ggml_type, &original),
            "{}",
            ggml_type.name()
        );
        // Each value is within half a quantization step of the original.
        let tolerance = match *ggml_type {
            GgmlType::F32 => 0.0,
            GgmlType::F16 => 1e-3,
            GgmlType::Q8_0 => 2.0 / 127.0,
            _ => 2.0 / 7.0,
        };
        for (g, o) in got.iter().zip(&original) {
            assert!(
                (g - o).abs() <= tolerance,
                "{}: {g} vs {o}",
                ggml_type.name()
            );
        }
        let bf16 = gguf.read_tensor(&format!("t{i}"), DType::Bf16).unwrap();
        assert!(matches!(bf16.data, TypedVec::Bf16(_)));
        assert_eq!(bf16.data, TypedVec::from_f32(DType::Bf16, &got));
    }
}

/// The fixture's blocks of `ggml_type` (`tests/fixtures/make_quant_blocks.py`) and their
/// values as the `gguf` package dequantizes them.
fn fixture_blocks(ggml_type: GgmlType) -> (Vec<u8>, Vec<f32>) {
    let fixture: serde_json::Value =
        serde_json::from_str(include_str!("../../../tests/fixtures/quant/blocks.json")).unwrap();
    let entry = &fixture[&ggml_type.name()];
    let hex = entry["bytes"].as_str().unwrap();
    let bytes = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
        .collect();
    let values = entry["values"].as_array().unwrap();
    (
        bytes,
        values.iter().map(|v| v.as_f64().unwrap() as f32).collect(),
    )
}

/// Every quantized type canopy reads, among them the K-quants and IQ4 types of llama.cpp's mixes
/// (`Q4_K_M` is Q4_K and Q6_K), read from a GGUF file as the `gguf` package dequantizes the
/// same blocks: to the bit in f32, and rounded once in bf16.
#[test]
fn quantized_tensors_read_as_the_gguf_package_dequantizes_them() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("blocks.gguf");
    let mut w = GgufWriter::default();
    let types: Vec<GgmlType> = (0..40)
        .map(GgmlType)
        .filter(|t| t.block_layout().is_some_and(|(elements, _)| elements > 1))
        .collect();
    let names: Vec<String> = types.iter().map(|t| t.name()).collect();
    assert_eq!(
        names,
        [
            "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
            "IQ4_NL", "IQ4_XS"
        ]
    );
    for &ggml_type in &types {
        let (bytes, values) = fixture_blocks(ggml_type);
        let row = ggml_type.block_layout().unwrap().0 as usize;
        w.raw_tensor(
            &ggml_type.name(),
            &[values.len() / row, row],
            ggml_type.0,
            bytes,
        );
    }
    w.write(&path);
    let gguf = GgufFile::open(&path).unwrap();
    for &ggml_type in &types {
        let (_, want) = fixture_blocks(ggml_type);
        let tensor = gguf.read_tensor(&ggml_type.name(), DType::F32).unwrap();
        let got = tensor.data.to_f32_vec();
        assert_eq!(got.len(), want.len(), "{}", ggml_type.name());
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            // The same f32 products in the same order: equal to the bit.
            assert_eq!(
                g.to_bits(),
                w.to_bits(),
                "{} element {i}: {g} against {w}",
                ggml_type.name()
            );
        }
        let bf16 = gguf.read_tensor(&ggml_type.name(), DType::Bf16).unwrap();
        assert_eq!(bf16.data, TypedVec::from_f32(DType::Bf16, &want));
    }
}

/// Every weight of `model`, read.
fn every_tensor(model: &Model) -> Vec<(WeightId, HostTensor)> {
    WeightId::all(&model.config)
        .into_iter()
        .map(|id| (id, model.weights.tensor(id).unwrap()))
        .collect()
}

#[test]
fn gguf_and_safetensors_load_identical_weights() {
    for tied in [false, true] {
        let fixture = fixture(tied);
        let from_gguf = Model::load(&fixture.gguf, DType::F32).unwrap();
        let from_hf = Model::load(&fixture.hf, DType::F32).unwrap();
        assert_eq!(from_gguf.config.tie_word_embeddings, tied);
        assert_eq!(from_gguf.weights.has_lm_head(), !tied);
        let shape = |part| {
            let tensor = from_gguf.weights.tensor(WeightId::Layer(1, part));
            tensor.unwrap().shape
        };
        // A prefetch hint reads nothing into the weights; a tied model's lm_head is none of
        // its tensors, and is skipped.
        for weights in [&from_gguf.weights, &from_hf.weights] {
            for id in WeightId::all(&from_gguf.config) {
                WeightSource::prefetch(weights, id);
            }
            WeightSource::prefetch(weights, WeightId::LmHead);
        }
        assert_eq!(shape(LayerPart::Q), [HEADS * HEAD_DIM, HIDDEN]);
        assert_eq!(shape(LayerPart::K), [KV_HEADS * HEAD_DIM, HIDDEN]);
        assert_eq!(shape(LayerPart::Down), [HIDDEN, INTERMEDIATE]);
        // Q and K come back in HF row order (unpermuted), every other tensor as stored.
        assert_eq!(
            every_tensor(&from_gguf),
            every_tensor(&from_hf),
            "tied = {tied}"
        );
        assert_eq!(
            from_gguf.config.weight_bytes(DType::F32),
            from_gguf.weights.size_bytes() as u64,
            "the shape prices its weights, tied = {tied}"
        );
        assert_eq!(from_gguf.config.head_dim, HEAD_DIM);
        assert_eq!(
            from_hf.config.eos_token_ids,
            [2, 0],
            "generation_config.json's eos wins"
        );
        assert_eq!(from_hf.generation.temperature, Some(0.6));
    }
}

/// Any part of a weight reads as the same elements of the whole: parts that start and end
/// inside quantization blocks and rows, from both formats, in f32 and bf16. A part that
/// runs past the weight's end is refused.
#[test]
fn parts_of_weights_read_as_the_whole() {
    let fixture = fixture(false);
    for path in [&fixture.gguf, &fixture.hf] {
        for dtype in [DType::F32, DType::Bf16] {
            let model = Model::load(path, dtype).unwrap();
            for id in WeightId::all(&model.config) {
                let whole = model.weights.tensor(id).unwrap().data;
                let len = whole.len();
                let parts = [
                    (0, len),
                    (1, len - 1),
                    (len / 3, len / 2),
                    (17, 33),
                    (len - 1, 1),
                    (len, 0),
                ];
                for (first, n) in parts {
                    let mut part = TypedVec::zeros(dtype, n);
                    model
                        .weights
                        .read_part(id, first, part.slice_mut(0..n))
                        .unwrap();
                    let at = format!("{} from {path:?}, {n} from {first}", id.name());
                    assert_eq!(part, whole.slice(first..first + n), "{at}");
                }
                let mut over = TypedVec::zeros(dtype, 2);
                let err = model
                    .weights
                    .read_part(id, len - 1, over.slice_mut(0..2))
                    .unwrap_err();
                assert!(matches!(err, ModelError::BufferMismatch { .. }), "{err}");
            }
        }
    }
}

#[test]
fn bf16_loading_converts_every_tensor() {
    let fixture = fixture(false);
    let model = Model::load(&fixture.gguf, DType::Bf16).unwrap();
    let f32_model = Model::load(&fixture.gguf, DType::F32).unwrap();
    let convert = |t: &HostTensor| TypedVec::from_f32(DType::Bf16, &t.data.to_f32_vec());
    for (id, tensor) in every_tensor(&f32_model) {
        let bf16 = model.weights.tensor(id).unwrap();
        assert_eq!(bf16.dtype(), DType::Bf16, "{}", id.name());
        assert_eq!(bf16.data, convert(&tensor), "{}", id.name());
    }
    assert_eq!(
        model.weights.size_bytes() * 2,
        f32_model.weights.size_bytes()
    );
}

#[test]
fn gguf_tokenizer_matches_control_tokens_and_digits_split() {
    let fixture = fixture(false);
    let model = Model::load(&fixture.gguf, DType::F32).unwrap();
    let tokenizer = &model.tokenizer;
    assert_eq!(tokenizer.vocab_size(), VOCAB);
    // "ab hi" → ab, Ġhi; control tokens are matched whole inside text.
    let ids = tokenizer
        .encode("<|im_start|>ab hi<|im_end|>", false)
        .unwrap();
    assert_eq!(ids, [1, 9, 11, 2]);
    assert_eq!(
        tokenizer.decode(&ids, false).unwrap(),
        "<|im_start|>ab hi<|im_end|>"
    );
    assert_eq!(tokenizer.decode(&ids, true).unwrap(), "ab hi");
    // The saved tokenizer.json of the HF twin tokenizes identically.
    let hf = Model::load(&fixture.hf, DType::F32).unwrap();
    assert_eq!(
        hf.tokenizer.encode("hi ab\nho a", false).unwrap(),
        tokenizer.encode("hi ab\nho a", false).unwrap()
    );
}

#[test]
fn gguf_add_bos_token_prepends_bos_with_special_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bos.gguf");
    let mut w = llama_gguf(false);
    w.meta("tokenizer.ggml.add_bos_token", Meta::Bool(true));
    w.write(&path);
    let tokenizer = Model::load(&path, DType::F32).unwrap().tokenizer;
    assert_eq!(tokenizer.encode("ab", true).unwrap(), [1, 9]);
    assert_eq!(tokenizer.encode("ab", false).unwrap(), [9]);
}

#[test]
fn incremental_decoding_never_splits_characters() {
    // A tokenizer whose tokens are single bytes of multi-byte characters: "é" is 0xC3 0xA9,
    // spelled "Ã" and "©" in GPT-2's byte-to-unicode alphabet.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bytes.gguf");
    let mut w = llama_gguf(false);
    let mut tokens: Vec<String> = TOKENS.iter().map(|t| t.to_string()).collect();
    tokens[13] = "Ã".into();
    tokens[15] = "©".into();
    w.meta("tokenizer.ggml.tokens", Meta::Strs(tokens));
    w.meta("tokenizer.ggml.merges", Meta::Strs(vec!["a b".into()]));
    w.write(&path);
    let model = Model::load(&path, DType::F32).unwrap();
    let ids = model.tokenizer.encode("abéaé", false).unwrap();
    assert_eq!(ids, [9, 13, 15, 3, 13, 15]);
    let mut decoder = model.tokenizer.incremental_decoder(false);
    let pieces: Vec<String> = ids.iter().map(|&id| decoder.push(id).unwrap()).collect();
    assert_eq!(pieces, ["ab", "", "é", "a", "", "é"]);
    assert_eq!(decoder.finish().unwrap(), "");
    // An unfinished character is flushed (as U+FFFD) at the end.
    let mut decoder = model.tokenizer.incremental_decoder(false);
    assert_eq!(decoder.push(3).unwrap(), "a");
    assert_eq!(decoder.push(13).unwrap(), "");
    assert_eq!(decoder.finish().unwrap(), "\u{FFFD}");
}

fn load_err(path: &Path) -> String {
    match Model::load(path, DType::F32) {
        Ok(_) => panic!("{} loaded but should not have", path.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn truncated_and_corrupt_gguf_files_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.gguf");
    let bytes = llama_gguf(false).to_bytes();

    std::fs::write(&path, &bytes[..bytes.len() - 100]).unwrap();
    let err = load_err(&path);
    assert!(
        err.contains("is not a readable GGUF file")
            && err.contains("output.weight")
            && err.contains("truncated"),
        "{err}"
    );

    std::fs::write(&path, &bytes[..1000]).unwrap();
    let err = load_err(&path);
    assert!(err.contains("truncated"), "{err}");

    let mut bad_magic = bytes.clone();
    bad_magic[..4].copy_from_slice(b"GGUX");
    std::fs::write(&path, &bad_magic).unwrap();
    assert!(load_err(&path).contains("bad magic"));

    // A string whose length runs past the end of the file.
    let mut bad_length = bytes[..24].to_vec();
    bad_length.extend(u64::MAX.to_le_bytes());
    std::fs::write(&path, &bad_length).unwrap();
    assert!(load_err(&path).contains("truncated"));

    std::fs::write(&path, b"").unwrap();
    assert!(load_err(&path).contains("truncated"));
}

#[test]
fn unsupported_quantization_names_type_and_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("iq2xxs.gguf");
    let mut w = llama_gguf(false);
    // IQ2_XXS (ggml type 16): 66 bytes per 256 elements.
    w.raw_tensor(
        "blk.0.attn_q.weight",
        &[HEADS * HEAD_DIM, HIDDEN],
        16,
        vec![0; 66 * 16],
    );
    w.write(&path);
    assert_eq!(
        load_err(&path),
        "unsupported quantization IQ2_XXS in tensor blk.0.attn_q.weight; canopy reads F32, F16, \
         BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K-Q6_K, IQ4_NL and IQ4_XS (convert the file with \
         llama.cpp's llama-quantize to one of them)"
    );
}

#[test]
fn shapes_that_contradict_the_config_name_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("shape.gguf");
    let mut w = llama_gguf(false);
    w.meta("llama.feed_forward_length", Meta::U32(128));
    w.write(&path);
    let err = load_err(&path);
    assert_eq!(
        err,
        "tensor blk.0.ffn_gate.weight has shape [96, 64] but the configuration implies [128, 64]"
    );
}

#[test]
fn other_architectures_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gpt2.gguf");
    let mut w = llama_gguf(false);
    w.meta("general.architecture", Meta::Str("gpt2".into()));
    w.write(&path);
    assert!(load_err(&path)
        .starts_with("unsupported architecture gpt2; canopy runs Llama-family models"));

    let fixture = fixture(false);
    let config = fixture.hf.join("config.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config).unwrap()).unwrap();
    json["architectures"] = serde_json::json!(["Qwen2ForCausalLM"]);
    json["model_type"] = serde_json::json!("qwen2");
    std::fs::write(&config, json.to_string()).unwrap();
    assert!(load_err(&fixture.hf).starts_with("unsupported architecture Qwen2ForCausalLM"));
}

#[test]
fn incomplete_hf_directories_name_the_missing_file() {
    for file in ["tokenizer.json", "model.safetensors", "config.json"] {
        let fixture = fixture(false);
        std::fs::remove_file(fixture.hf.join(file)).unwrap();
        let err = load_err(&fixture.hf);
        let named = if file == "model.safetensors" {
            "has no model.safetensors (or model.safetensors.index.json)"
        } else {
            &format!("has no {file};")
        };
        assert!(err.contains(named), "{err}");
    }
    let err = load_err(Path::new("/nonexistent/model"));
    assert!(
        err.contains("is neither a model directory nor a .gguf file"),
        "{err}"
    );
}

#[test]
fn bad_safetensors_are_refused() {
    let fixture = fixture(false);
    let weights = fixture.hf.join("model.safetensors");
    let bytes = std::fs::read(&weights).unwrap();
    std::fs::write(&weights, &bytes[..bytes.len() - 10]).unwrap();
    let err = Model::load(&fixture.hf, DType::F32).err().unwrap();
    assert!(matches!(err, ModelError::Safetensors { .. }), "{err}");
    assert!(
        std::error::Error::source(&err).is_some(),
        "the safetensors error is kept as the source"
    );

    // A well-formed file that lacks one of the model's tensors.
    let views: Vec<(String, TensorView)> = Vec::new();
    std::fs::write(&weights, safetensors::serialize(views, None).unwrap()).unwrap();
    assert!(load_err(&fixture.hf).contains("has no tensor model.embed_tokens.weight"));
}

#[test]
fn sharded_safetensors_load_like_one_file() {
    let fixture = fixture(false);
    let whole = Model::load(&fixture.hf, DType::F32).unwrap();
    // Split model.safetensors in two shards by layer, with an index naming them.
    let bytes = std::fs::read(fixture.hf.join("model.safetensors")).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut weight_map = serde_json::Map::new();
    let mut shards: [Vec<(String, TensorView)>; 2] = [Vec::new(), Vec::new()];
    for (name, view) in file.tensors() {
        let shard = usize::from(name.contains("layers.1") || name.starts_with("lm_head"));
        let file_name = format!("model-0000{}-of-00002.safetensors", shard + 1);
        weight_map.insert(name.clone(), file_name.into());
        shards[shard].push((name, view));
    }
    for (i, shard) in shards.into_iter().enumerate() {
        let path = fixture
            .hf
            .join(format!("model-0000{}-of-00002.safetensors", i + 1));
        std::fs::write(path, safetensors::serialize(shard, None).unwrap()).unwrap();
    }
    std::fs::remove_file(fixture.hf.join("model.safetensors")).unwrap();
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(
        fixture.hf.join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
    assert_eq!(
        every_tensor(&Model::load(&fixture.hf, DType::F32).unwrap()),
        every_tensor(&whole)
    );
}

#[test]
fn a_model_without_a_chat_template_says_to_drop_chat() {
    let fixture = fixture(false);
    let model = Model::load(&fixture.gguf, DType::F32).unwrap();
    let err = model.chat_template().unwrap_err();
    assert!(matches!(err, ModelError::NoChatTemplate));
    assert!(err.to_string().contains("run without --chat"));
}

#[test]
fn gguf_chat_template_uses_the_files_special_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("chat.gguf");
    let mut w = llama_gguf(false);
    w.meta("tokenizer.chat_template", Meta::Str("{{ bos_token }}{% for m in messages %}{{ m.role }}:{{ m.content }}{{ eos_token }}{% endfor %}".into()));
    w.write(&path);
    let model = Model::load(&path, DType::F32).unwrap();
    let text = model
        .chat_template()
        .unwrap()
        .render(&[canopy_model::ChatMessage::new("user", "hi")], true)
        .unwrap();
    assert_eq!(text, "<|im_start|>user:hi<|im_end|>");
}

#[test]
fn no_truncation_or_corrupted_byte_panics() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fuzz.gguf");
    let bytes = llama_gguf(false).to_bytes();
    for len in (0..bytes.len()).step_by(97) {
        std::fs::write(&path, &bytes[..len]).unwrap();
        assert!(
            Model::load(&path, DType::F32).is_err(),
            "{len} bytes loaded"
        );
    }
    // Bytes of the header, metadata and tensor infos (the first 4 KiB), set to values that
    // make lengths, counts, types and offsets absurd.
    for at in (0..4096).step_by(7) {
        for value in [0x00, 0xff] {
            let mut corrupt = bytes.clone();
            corrupt[at] = value;
            std::fs::write(&path, &corrupt).unwrap();
            let _ = Model::load(&path, DType::F32);
        }
    }
}
