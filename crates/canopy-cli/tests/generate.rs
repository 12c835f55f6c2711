//! `canopy generate` end to end on the tiny fixture models (tests/fixtures/tiny): JSON and
//! streamed output, the same tokens on every rank count and strategy, and bad input refused
//! with a clear message.

mod common;

use assert_cmd::Command;
use common::canopy;
use predicates::prelude::*;
use predicates::str::contains;
use serde_json::Value;

use common::tiny_model as tiny;

/// The `--json` report of `args`.
fn report(args: &[&str]) -> Value {
    let out = canopy()
        .args(args)
        .arg("--json")
        .assert()
        .success()
        .get_output()
        .stdout
        .clone();
    serde_json::from_slice(&out).expect("JSON")
}

fn tokens(args: &[&str]) -> Vec<Value> {
    report(args)["samples"].as_array().unwrap().clone()
}

/// `base` with `extra` after it.
fn with<'a>(base: &[&'a str], extra: &[&'a str]) -> Vec<&'a str> {
    [base, extra].concat()
}

/// The samples of `base` alone, after checking that each of `variants` (extra arguments)
/// generates the same first sample's tokens.
fn same_tokens_in_every(base: &[&str], variants: &[&[&str]]) -> Vec<Value> {
    let one = tokens(base);
    for extra in variants {
        let got = tokens(&with(base, extra));
        assert_eq!(got[0]["tokens"], one[0]["tokens"], "{extra:?}");
    }
    one
}

#[test]
fn every_rank_count_and_strategy_generates_the_same_tokens() {
    let model = tiny("gqa-hd64");
    let base = [
        "generate",
        "--model",
        &model,
        "--prompt",
        "the quick brown fox",
        "--max-tokens",
        "12",
    ];
    let one = same_tokens_in_every(
        &base,
        &[
            &["--ranks", "2"],
            &["--ranks", "3", "--strategy", "ring"],
            &["--ranks", "4", "--collective", "allgather"],
        ],
    );
    assert_eq!(one[0]["tokens"].as_array().unwrap().len(), 12);
    assert_eq!(one[0]["finish_reason"], "length");
    for s in tokens(&with(&base, &["--n", "3"])) {
        assert_eq!(
            s["tokens"], one[0]["tokens"],
            "greedy samples are the greedy text"
        );
    }
}

/// The timing gives the weights' load apart from the request, and the mean decode step and
/// the median one, in the JSON and on stderr.
#[test]
fn the_timing_reports_the_load_and_the_mean_and_the_median_step() {
    let model = tiny("gqa-hd64");
    let args = [
        "generate",
        "--model",
        &model,
        "--prompt",
        "the quick brown fox",
    ];
    let v = report(&with(&args, &["--max-tokens", "8"]));
    for field in ["decode_ms_per_token", "decode_median_step_ms"] {
        let ms = v[field].as_f64().unwrap_or(f64::NAN);
        assert!(ms.is_finite() && ms > 0.0, "{field}: {}", v[field]);
    }
    let seconds = |field: &str| v[field].as_f64().unwrap_or(f64::NAN);
    assert!(seconds("load_s") > 0.0, "load_s: {}", v["load_s"]);
    assert!(seconds("ttft_s") >= seconds("prefill_s"), "{v}");
    canopy()
        .args(args)
        .args(["--max-tokens", "4"])
        .assert()
        .success()
        .stderr(contains("weights loaded in").and(contains("ms/token, median step")));
}

/// A random context is a function of its positions alone: one rank, the tree over 2 and 3
/// ranks, and the ring decode the same greedy tokens after it.
#[test]
fn a_random_context_is_the_same_on_any_rank_count() {
    let model = tiny("gqa-hd64");
    let base = [
        "generate",
        "--model",
        &model,
        "--max-tokens",
        "6",
        "--context",
        "700",
        "--context-fill",
        "random",
    ];
    same_tokens_in_every(
        &base,
        &[
            &["--ranks", "2"],
            &["--ranks", "3"],
            &["--ranks", "2", "--strategy", "ring"],
        ],
    );
}

#[test]
fn a_stand_in_context_decodes_every_token_asked_for_past_the_positions() {
    // The fixture holds 512 positions; a random fill runs past them, a prefill may not.
    let model = tiny("llama3-hd128");
    let base = ["generate", "--model", &model, "--max-tokens", "7"];
    for extra in [
        &["--context", "300"][..],
        &[
            "--context",
            "1K",
            "--context-fill",
            "random",
            "--ranks",
            "2",
        ],
        &[
            "--context",
            "1K",
            "--context-fill",
            "random",
            "--strategy",
            "ring",
        ],
    ] {
        let samples = tokens(&with(&base, extra));
        assert_eq!(
            samples[0]["tokens"].as_array().unwrap().len(),
            7,
            "{extra:?}"
        );
        assert_eq!(samples[0]["finish_reason"], "length", "{extra:?}");
    }
    canopy()
        .args(base)
        .args(["--context", "1K"])
        .assert()
        .failure()
        .stderr(contains("exceeds the model's capacity"));
    canopy()
        .args(base)
        .args(["--context", "1K", "--prompt", "hi"])
        .assert()
        .failure()
        .stderr(contains("cannot be used with"));
}

#[test]
fn text_streams_and_a_timing_line_follows() {
    canopy()
        .args([
            "generate",
            "--model",
            &tiny("gqa-hd64"),
            "--chat",
            "--system",
            "Be brief.",
        ])
        .args(["--prompt", "hello", "--max-tokens", "6"])
        .assert()
        .success()
        .stdout(predicate::str::is_empty().not())
        .stderr(contains("prompt tokens; prefill"))
        .stderr(contains("ms/token"));
}

#[test]
fn bad_models_and_requests_are_refused_with_what_to_do() {
    canopy()
        .args(["generate", "--model", "/no/such/model", "--prompt", "hi"])
        .assert()
        .failure()
        .stderr(contains("/no/such/model"))
        .stderr(contains("panicked").not());
    canopy()
        .args([
            "generate",
            "--model",
            &tiny("tied-mha-hd64"),
            "--chat",
            "--prompt",
            "hi",
        ])
        .assert()
        .failure()
        .stderr(contains("--chat"));
    // The tiny models hold 256 or 512 positions.
    canopy()
        .args([
            "generate",
            "--model",
            &tiny("gqa-hd64"),
            "--prompt",
            "hi",
            "--max-tokens",
            "5000",
        ])
        .assert()
        .failure()
        .stderr(contains("capacity of 256 tokens"));
    // Within the capacity but beyond the memory `ulimit -v` leaves: refused, not killed.
    let bin = assert_cmd::cargo::cargo_bin("canopy");
    Command::new("sh")
        .arg("-c")
        .arg(format!(
            "ulimit -v 1000000 && exec '{}' generate --model '{}' --prompt hi --max-tokens 500 --n 2000",
            bin.display(),
            tiny("llama3-hd128")
        ))
        .assert()
        .failure()
        .stderr(contains("GiB of host memory"));
    let dir = std::env::temp_dir().join(format!("canopy-partial-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(
        format!("{}/config.json", tiny("gqa-hd64")),
        dir.join("config.json"),
    )
    .unwrap();
    canopy()
        .args([
            "generate",
            "--model",
            dir.to_str().unwrap(),
            "--prompt",
            "hi",
        ])
        .assert()
        .failure()
        .stderr(contains("tokenizer.json").or(contains("safetensors")));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--prompt-ids` feeds a reference's ids as they are, and `--logits` reports what chose each
/// token: the first logits equal transformers' (f32), every step's top token is the token
/// drawn, and bf16 weights and KV stay close to the f32 logits.
#[test]
fn prompt_ids_and_logits_reproduce_the_reference() {
    let model = tiny("gqa-hd64");
    let text = std::fs::read_to_string(format!("{model}/reference.json")).unwrap();
    let reference: Value = serde_json::from_str(&text).unwrap();
    let prompt = &reference["prompts"][1];
    let ids: Vec<String> = prompt["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.to_string())
        .collect();
    let ids = ids.join(",");
    let run = |dtype: &str| -> Value {
        report(&[
            "generate",
            "--model",
            &model,
            "--backend",
            "cpu",
            "--dtype",
            dtype,
            "--prompt-ids",
            &ids,
            "--max-tokens",
            "8",
            "--ranks",
            "2",
            "--logits",
        ])
    };
    let floats = |v: &Value| -> Vec<f64> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect()
    };
    let want = floats(&prompt["logits_last"]);
    let scale = want.iter().fold(0.0f64, |m, x| m.max(x.abs()));
    let worst = |got: &[f64]| {
        got.iter()
            .zip(&want)
            .map(|(g, w)| (g - w).abs())
            .fold(0.0, f64::max)
            / scale
    };
    let f32_run = run("f32");
    assert_eq!(f32_run["dtype"], "f32");
    assert!(worst(&floats(&f32_run["logits"]["first"])) < 1e-4);
    let drawn = f32_run["samples"][0]["tokens"].as_array().unwrap();
    let steps = f32_run["logits"]["steps"].as_array().unwrap();
    assert_eq!(steps.len(), drawn.len());
    for (step, token) in steps.iter().zip(drawn) {
        assert_eq!(&step["token"], token);
        assert!(step["logit"].as_f64() >= step["second_logit"].as_f64());
    }
    assert_eq!(
        drawn[..],
        prompt["greedy_tokens"].as_array().unwrap()[..8],
        "greedy tokens"
    );
    let bf16_run = run("bf16");
    assert_eq!(bf16_run["dtype"], "bf16");
    let err = worst(&floats(&bf16_run["logits"]["first"]));
    assert!(err > 0.0 && err < 5e-2, "bf16 error {err}");
}

#[test]
fn log_probabilities_come_with_the_same_tokens() {
    let model = tiny("gqa-hd64");
    let base = [
        "generate",
        "--model",
        &model,
        "--backend",
        "cpu",
        "--prompt-ids",
        "5,9,14,2,33",
        "--max-tokens",
        "6",
        "--n",
        "2",
        "--temperature",
        "0.8",
        "--top-k",
        "5",
    ];
    let plain = tokens(&base);
    let with_logprobs = report(&with(&base, &["--logprobs", "3", "--logits"]));
    let samples = with_logprobs["samples"].as_array().unwrap();
    // The first logits, for the first token's log-probability.
    let first: Vec<f64> = serde_json::from_value(with_logprobs["logits"]["first"].clone()).unwrap();
    let max = first.iter().copied().fold(f64::MIN, f64::max);
    let log_total = max + first.iter().map(|x| (x - max).exp()).sum::<f64>().ln();
    for (got, want) in samples.iter().zip(&plain) {
        assert_eq!(got["tokens"], want["tokens"], "the same draws");
        let tokens = got["tokens"].as_array().unwrap();
        let lps = got["logprobs"].as_array().unwrap();
        assert_eq!(lps.len(), tokens.len());
        let token = tokens[0].as_u64().unwrap() as usize;
        let lp = lps[0]["logprob"].as_f64().unwrap();
        assert!((lp - (first[token] - log_total)).abs() < 1e-4, "{lp}");
        for lp in lps {
            let top = lp["top"].as_array().unwrap();
            assert_eq!(top.len(), 3);
            assert!(lp["logprob"].as_f64().unwrap() <= top[0][1].as_f64().unwrap() + 1e-6);
        }
    }
    assert!(plain[0].get("logprobs").is_none());
    canopy()
        .args(with(&base, &["--json", "--logprobs", "21"]))
        .assert()
        .failure()
        .stderr(contains("from 0 to 20"));
}
