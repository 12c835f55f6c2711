//! `canopy bench decode` on the CPU: a real model prefilled and a preset shape with random
//! weights and a random context, every rank count and strategy reported, bad requests refused.

use assert_cmd::Command;
use predicates::str::contains;
use serde_json::Value;

fn canopy() -> Command {
    Command::cargo_bin("canopy").expect("the canopy binary is built")
}

fn report(args: &[&str]) -> Value {
    let out = canopy()
        .args(["bench", "decode", "--backend", "cpu", "--json"])
        .args(args)
        .assert()
        .success()
        .get_output()
        .stdout
        .clone();
    serde_json::from_slice(&out).expect("JSON")
}

#[test]
fn every_configuration_is_timed() {
    let model = format!(
        "{}/../../tests/fixtures/tiny/gqa-hd64",
        env!("CARGO_MANIFEST_DIR")
    );
    let r = report(&[
        "--model",
        &model,
        "--context",
        "40,70",
        "--ranks",
        "1,2",
        "--strategy",
        "tree,ring",
        "--decode",
        "3",
    ]);
    let rows = r["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 8);
    for row in rows {
        assert_eq!(row["context_fill"], "prefill");
        assert!(row["decode_ms_per_token"].as_f64().unwrap() > 0.0);
        // The CPU has no measured copy bandwidth, so no floor.
        assert!(row["floor_ms"].is_null());
    }
    assert_eq!(rows[7]["context"], 70);
    assert_eq!(rows[7]["ranks"], 2);
    assert_eq!(rows[7]["strategy"], "ring");
}

#[test]
fn a_preset_runs_on_random_weights_and_a_random_context() {
    let r = report(&[
        "--arch",
        "smollm2-135m",
        "--random-weights",
        "--context",
        "1K",
        "--context-fill",
        "random",
        "--decode",
        "2",
    ]);
    assert_eq!(r["model"], "smollm2-135m");
    // 134.5M parameters in f32.
    let bytes = r["weight_bytes"].as_u64().unwrap();
    assert!((538_000_000..539_000_000).contains(&bytes), "{bytes}");
    assert_eq!(r["rows"][0]["context"], 1024);
    assert_eq!(r["rows"][0]["context_fill"], "random");
}

#[test]
fn bad_requests_are_refused_with_what_to_do() {
    canopy()
        .args([
            "bench",
            "decode",
            "--backend",
            "cpu",
            "--arch",
            "llama-9",
            "--random-weights",
        ])
        .assert()
        .failure()
        .stderr(contains("the presets are llama-3.1-8b"));
    canopy()
        .args([
            "bench",
            "decode",
            "--backend",
            "cpu",
            "--arch",
            "smollm2-135m",
        ])
        .assert()
        .failure()
        .stderr(contains("--random-weights"));
    canopy()
        .args([
            "bench",
            "decode",
            "--backend",
            "cpu",
            "--arch",
            "smollm2-135m",
        ])
        .args(["--random-weights", "--context", "8K"])
        .assert()
        .failure()
        .stderr(contains("capacity of 8192 tokens"));
}
