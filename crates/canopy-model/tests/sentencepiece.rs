//! A GGUF sentencepiece vocabulary (`tokenizer.ggml.model = "llama"`: Llama 2, TinyLlama,
//! Mistral) tokenizes as the model's own sentencepiece tokenizer does, the way llama.cpp cuts
//! text at control tokens (`tests/fixtures/spm/`, made by `make_spm_gguf.py`), and decodes back.

use std::path::PathBuf;

use canopy_model::{GgufFile, Tokenizer};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/spm")
        .join(name)
}

fn tokenizer() -> Tokenizer {
    Tokenizer::from_gguf(&GgufFile::open(&fixture("tokenizer.gguf")).unwrap()).unwrap()
}

struct Case {
    text: String,
    ids: Vec<u32>,
    ids_plain: Vec<u32>,
}

fn cases() -> Vec<Case> {
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("expected.json")).unwrap()).unwrap();
    let ids = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    doc["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| Case {
            text: c["text"].as_str().unwrap().to_string(),
            ids: ids(&c["ids"]),
            ids_plain: ids(&c["ids_plain"]),
        })
        .collect()
}

#[test]
fn encodes_as_sentencepiece_does() {
    let tok = tokenizer();
    let cases = cases();
    assert!(cases.len() >= 10);
    for case in &cases {
        assert_eq!(
            tok.encode(&case.text, true).unwrap(),
            case.ids,
            "{:?}",
            case.text
        );
        assert_eq!(
            tok.encode(&case.text, false).unwrap(),
            case.ids_plain,
            "{:?}",
            case.text
        );
    }
}

#[test]
fn decodes_text_back_whole_and_streamed() {
    let tok = tokenizer();
    // A control token spelled in the text is matched as the token, which decodes to nothing.
    for case in cases().iter().filter(|c| !c.text.contains("<s>")) {
        assert_eq!(
            tok.decode(&case.ids, true).unwrap(),
            case.text,
            "{:?}",
            case.text
        );
        let mut stream = tok.incremental_decoder(true);
        let mut text = String::new();
        for &id in &case.ids {
            text.push_str(&stream.push(id).unwrap());
        }
        assert_eq!(text, case.text, "streamed {:?}", case.text);
    }
}

#[test]
fn each_piece_stands_for_its_bytes() {
    let tok = tokenizer();
    for case in cases().iter().filter(|c| !c.text.contains("<s>")) {
        let bytes: Vec<u8> = case
            .ids_plain
            .iter()
            .flat_map(|&id| tok.token_bytes(id))
            .collect();
        // The pieces hold the dummy prefix's space, which decoding a whole text strips.
        let text = String::from_utf8(bytes).expect("whole pieces are whole characters");
        assert!(
            text == case.text || text.strip_prefix(' ') == Some(&case.text),
            "{text:?} for {:?}",
            case.text
        );
    }
}
