//! Real models: the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) when it is in the
//! cache, and the tiny Hugging Face models in `tests/fixtures/tiny/`, each checked against
//! what transformers made of them (`reference.json`, written by the scripts in
//! `tests/fixtures/`). A model or fixture that is absent is skipped with a note; set
//! `CANOPY_TEST_FETCH=1` to fetch the default model with pip first.

use std::path::{Path, PathBuf};
use std::time::Instant;

use canopy_core::DType;
use canopy_model::{ChatMessage, LayerPart, Model, ModelError, Tokenizer, WeightId};
use serde_json::Value;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

fn read_json(path: &Path) -> Option<Value> {
    let text = std::fs::read_to_string(path).ok()?;
    Some(serde_json::from_str(&text).expect("fixture JSON parses"))
}

fn ids(value: &Value) -> Vec<u32> {
    value
        .as_array()
        .expect("an array of ids")
        .iter()
        .map(|id| id.as_u64().expect("an id") as u32)
        .collect()
}

fn messages(value: &Value) -> Vec<ChatMessage> {
    value
        .as_array()
        .expect("an array of messages")
        .iter()
        .map(|m| ChatMessage::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
        .collect()
}

/// The default model, by [`canopy_model::default_model_for_tests`]'s rule.
fn smollm2() -> Option<PathBuf> {
    canopy_model::default_model_for_tests().expect("fetching the default model")
}

/// Checks the streamed text of `ids` against the text decoded all at once.
fn check_streaming(tokenizer: &Tokenizer, ids: &[u32], skip_special: bool) {
    let mut decoder = tokenizer.incremental_decoder(skip_special);
    let mut streamed = String::new();
    for &id in ids {
        streamed += &decoder.push(id).unwrap();
    }
    streamed += &decoder.finish().unwrap();
    assert_eq!(streamed, tokenizer.decode(ids, skip_special).unwrap());
}

#[test]
fn smollm2_loads_with_its_config_tokenizer_and_template() {
    let Some(path) = smollm2() else { return };
    let start = Instant::now();
    let model = Model::load(&path, DType::F32).unwrap();
    eprintln!(
        "loaded {} as f32 in {:.2} s ({} MiB of weights)",
        path.display(),
        start.elapsed().as_secs_f64(),
        model.weights.size_bytes() >> 20
    );
    let c = &model.config;
    assert_eq!(
        (c.num_hidden_layers, c.hidden_size, c.intermediate_size),
        (30, 576, 1536)
    );
    assert_eq!(
        (c.num_attention_heads, c.num_key_value_heads, c.head_dim),
        (9, 3, 64)
    );
    assert_eq!((c.vocab_size, c.max_position_embeddings), (49152, 8192));
    assert_eq!(c.rope_theta, 100_000.0);
    assert!((c.rms_norm_eps - 1e-5).abs() < 1e-12);
    assert!(c.tie_word_embeddings && !model.weights.has_lm_head());
    assert_eq!(
        (c.bos_token_id, c.eos_token_ids.as_slice()),
        (Some(1), &[2][..])
    );
    let shape = |id| model.weights.tensor(id).unwrap().shape;
    assert_eq!(shape(WeightId::Embed), [49152, 576]);
    assert_eq!(shape(WeightId::Layer(29, LayerPart::K)), [192, 576]);

    let text = "The capital of France is Paris. 1234 ünïcödé 🦀";
    let ids = model.tokenizer.encode(text, true).unwrap();
    assert_eq!(model.tokenizer.decode(&ids, false).unwrap(), text);
    check_streaming(&model.tokenizer, &ids, false);
    // Token by token, the pieces' bytes spell the text, though the crab's pieces are no
    // characters alone.
    let pieces: Vec<Vec<u8>> = ids
        .iter()
        .map(|&id| model.tokenizer.token_bytes(id))
        .collect();
    assert_eq!(pieces.concat(), text.as_bytes());
    assert!(pieces.iter().any(|p| std::str::from_utf8(p).is_err()));

    let conversation = [
        ChatMessage::new("system", "You are terse."),
        ChatMessage::new("user", "Hi!"),
    ];
    let rendered = model
        .chat_template()
        .unwrap()
        .render(&conversation, true)
        .unwrap();
    assert_eq!(rendered, "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n");

    let bf16_start = Instant::now();
    let bf16 = Model::load(&path, DType::Bf16).unwrap();
    eprintln!(
        "loaded as bf16 in {:.2} s",
        bf16_start.elapsed().as_secs_f64()
    );
    assert_eq!(bf16.weights.size_bytes() * 2, model.weights.size_bytes());
}

/// Elements of SmolLM2's weights as the `gguf` Python package dequantizes them, with Q and K
/// rows put back in HF order by transformers' reverse permutation: Q8_0 (embedding), Q4_1
/// (projections) and F32 (norms), through canopy's own dequantizer and unpermutation.
#[test]
fn smollm2_weights_match_gguf_py() {
    let Some(path) = smollm2() else { return };
    let weights = Model::load(&path, DType::F32).unwrap().weights;
    let tensor = |id| weights.tensor(id).unwrap();
    let layer = |l, part| tensor(WeightId::Layer(l, part));
    // Values are exact f32 numbers, written in full (as f64) to compare bit for bit.
    struct Case<'a> {
        name: &'a str,
        tensor: canopy_model::HostTensor,
        elements: [(usize, usize, f64); 3],
        row_sums: [f64; 3],
    }
    let cases = [
        Case {
            name: "blk.0.attn_q",
            tensor: layer(0, LayerPart::Q),
            elements: [
                (1, 0, -0.1591796875),
                (33, 5, -0.06280517578125),
                (575, 100, 0.1810302734375),
            ],
            row_sums: [1.00726318359375, -0.7210693359375, -0.71209716796875],
        },
        Case {
            name: "blk.0.attn_k",
            tensor: layer(0, LayerPart::K),
            elements: [
                (1, 0, 0.203369140625),
                (33, 5, 0.22955322265625),
                (191, 100, 0.09130859375),
            ],
            row_sums: [3.87286376953125, 3.16705322265625, -12.913482666015625],
        },
        Case {
            name: "blk.29.attn_k",
            tensor: layer(29, LayerPart::K),
            elements: [
                (1, 0, 0.05859375),
                (33, 5, -0.012451171875),
                (191, 100, 1.15594482421875),
            ],
            row_sums: [-1.0412521362304688, 1.5659332275390625, 2.2914886474609375],
        },
        Case {
            name: "token_embd",
            tensor: tensor(WeightId::Embed),
            elements: [
                (1, 0, -0.0238037109375),
                (33, 5, -0.059051513671875),
                (49151, 100, -0.026912689208984375),
            ],
            row_sums: [-2.2541093826293945, 5.6242170333862305, 0.5320634841918945],
        },
        Case {
            name: "blk.3.ffn_down",
            tensor: layer(3, LayerPart::Down),
            elements: [
                (1, 0, -0.50390625),
                (33, 5, -0.060516357421875),
                (575, 100, 0.127288818359375),
            ],
            row_sums: [2.892364501953125, -0.367034912109375, -4.4217529296875],
        },
    ];
    for Case {
        name,
        tensor,
        elements,
        row_sums,
    } in cases
    {
        let values = tensor.data.to_f32_vec();
        let cols = tensor.shape[1];
        for (row, col, want) in elements {
            assert_eq!(
                f64::from(values[row * cols + col]),
                want,
                "{name}[{row}, {col}]"
            );
        }
        for (row, want) in [0, 31, 32].into_iter().zip(row_sums) {
            let sum: f64 = values[row * cols..(row + 1) * cols]
                .iter()
                .map(|&v| f64::from(v))
                .sum();
            assert!(
                (sum - want).abs() < 1e-9,
                "{name} row {row}: {sum} vs {want}"
            );
        }
    }
    let norm = tensor(WeightId::FinalNorm).data.to_f32_vec();
    assert_eq!(
        (norm[0], norm[100], norm[575]),
        (1.7578125, 2.09375, 1.984375)
    );
}

/// transformers' token ids, chat rendering and decoded continuations for SmolLM2.
#[test]
fn smollm2_matches_transformers_reference() {
    let reference_path = fixtures().join("smollm2/reference.json");
    let Some(reference) = read_json(&reference_path) else {
        eprintln!("note: {} is absent; skipping", reference_path.display());
        return;
    };
    let Some(path) = smollm2() else { return };
    let model = Model::load(&path, DType::F32).unwrap();
    let expected = &reference["config"];
    let c = &model.config;
    assert_eq!(
        c.num_hidden_layers as u64,
        expected["num_hidden_layers"].as_u64().unwrap()
    );
    assert_eq!(c.head_dim as u64, expected["head_dim"].as_u64().unwrap());
    assert_eq!(c.rms_norm_eps, expected["rms_norm_eps"].as_f64().unwrap());
    assert_eq!(
        model.chat_template().unwrap().source(),
        reference["tokenizer"]["chat_template"].as_str().unwrap()
    );

    let tokenizer = &model.tokenizer;
    for prompt in reference["prompts"].as_array().unwrap() {
        let token_ids = ids(&prompt["token_ids"]);
        let text = if prompt["kind"] == "chat" {
            let add_generation_prompt = prompt["add_generation_prompt"].as_bool().unwrap();
            let rendered = model
                .chat_template()
                .unwrap()
                .render(&messages(&prompt["messages"]), add_generation_prompt)
                .unwrap();
            assert_eq!(rendered, prompt["rendered"].as_str().unwrap());
            rendered
        } else {
            prompt["text"].as_str().unwrap().to_string()
        };
        assert_eq!(
            tokenizer.encode(&text, true).unwrap(),
            token_ids,
            "{text:?}"
        );
        let generated = ids(&prompt["greedy_tokens"]);
        assert_eq!(
            tokenizer.decode(&generated, false).unwrap(),
            prompt["continuation_text"].as_str().unwrap()
        );
        assert_eq!(
            tokenizer.decode(&generated, true).unwrap(),
            prompt["continuation_text_skip_special"].as_str().unwrap()
        );
        check_streaming(tokenizer, &generated, false);
        check_streaming(tokenizer, &generated, true);
    }
}

/// The tiny random models in `tests/fixtures/tiny/`: config, shapes, tokenizer probes and
/// chat renderings as transformers produced them.
#[test]
fn tiny_fixture_models_match_transformers_reference() {
    let root = fixtures().join("tiny");
    let Ok(entries) = std::fs::read_dir(&root) else {
        eprintln!("note: {} is absent; skipping", root.display());
        return;
    };
    let mut checked = 0;
    for dir in entries
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("reference.json").is_file())
    {
        let reference = read_json(&dir.join("reference.json")).unwrap();
        let model = Model::load(&dir, DType::F32).unwrap();
        let c = &model.config;
        let expected = &reference["config"];
        for (name, value) in [
            ("hidden_size", c.hidden_size),
            ("num_attention_heads", c.num_attention_heads),
            ("num_key_value_heads", c.num_key_value_heads),
            ("head_dim", c.head_dim),
            ("intermediate_size", c.intermediate_size),
            ("num_hidden_layers", c.num_hidden_layers),
        ] {
            assert_eq!(
                value as u64,
                expected[name].as_u64().unwrap(),
                "{}: {name}",
                dir.display()
            );
        }
        assert_eq!(c.rope_theta, expected["rope_theta"].as_f64().unwrap());
        assert_eq!(
            c.rope_scaling.is_some(),
            expected.get("rope_scaling").is_some_and(|s| !s.is_null())
        );
        assert_eq!(c.tie_word_embeddings, !model.weights.has_lm_head());
        assert_eq!(
            model.weights.tensor(WeightId::Embed).unwrap().shape,
            [
                reference["vocab_size"].as_u64().unwrap() as usize,
                c.hidden_size
            ]
        );

        for probe in reference["tokenizer_probes"].as_array().unwrap() {
            let text = probe["text"].as_str().unwrap();
            assert_eq!(
                model.tokenizer.encode(text, true).unwrap(),
                ids(&probe["ids"]),
                "{text:?}"
            );
            assert_eq!(
                model.tokenizer.encode(text, false).unwrap(),
                ids(&probe["ids_no_special"]),
                "{text:?}"
            );
            let decoded = model
                .tokenizer
                .decode(&ids(&probe["ids_no_special"]), false)
                .unwrap();
            assert_eq!(decoded, probe["decoded"].as_str().unwrap());
        }
        for prompt in reference["prompts"].as_array().unwrap() {
            let text = prompt["text"].as_str().unwrap();
            assert_eq!(
                model.tokenizer.encode(text, false).unwrap(),
                ids(&prompt["token_ids"]),
                "{text:?}"
            );
        }
        if reference["has_chat_template"].as_bool().unwrap() {
            for chat in reference["chat"].as_array().unwrap() {
                let add_generation_prompt = chat["add_generation_prompt"].as_bool().unwrap();
                let rendered = model
                    .chat_template()
                    .unwrap()
                    .render(&messages(&chat["messages"]), add_generation_prompt)
                    .unwrap();
                assert_eq!(rendered, chat["rendered"].as_str().unwrap());
                assert_eq!(
                    model.tokenizer.encode(&rendered, false).unwrap(),
                    ids(&chat["token_ids"])
                );
            }
        } else {
            assert!(matches!(
                model.chat_template(),
                Err(ModelError::NoChatTemplate)
            ));
        }
        checked += 1;
    }
    eprintln!("checked {checked} tiny fixture models");
}
