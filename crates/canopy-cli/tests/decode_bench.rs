//! `canopy bench decode` on the CPU: a real model prefilled and a preset shape with random
//! weights and a random context, every rank count and strategy reported, bad requests refused.

mod common;

use assert_cmd::Command;
use common::{canopy, font};
use predicates::str::contains;
use serde_json::Value;

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
        assert!(row["decode_mean_ms_per_token"].as_f64().unwrap() > 0.0);
        // The CPU records no graphs.
        assert_eq!(row["replayed_steps"], 0);
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

#[test]
fn tree_and_ring_are_reported_as_table_1_with_csv_and_plot() {
    let dir = std::env::temp_dir().join(format!("canopy-decode-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (csv, plot) = (dir.join("decode.csv"), dir.join("decode.svg"));
    let mut args = vec![
        "--arch",
        "smollm2-135m",
        "--random-weights",
        "--context",
        "64,128",
        // Two steps: the first timed as it runs, the second with its merges timed.
        "--decode",
        "3",
        "--strategy",
        "tree,ring",
        "--ranks",
        "1,2",
        "--csv",
        csv.to_str().unwrap(),
    ];
    if font() {
        args.extend(["--plot", plot.to_str().unwrap()]);
    }
    let r = report(&args);
    assert!(r["gemm_tflops"].as_f64().unwrap() > 0.0);
    assert_eq!(r["gemm_shape"], "256 × 3072 × 576", "the model's gate|up");
    assert!(r["peak_memory"].as_str().unwrap().contains("VmHWM"));
    let capacity = r["capacity"].as_array().unwrap();
    assert_eq!(capacity.len(), 2);
    // 8192 positions less the 3 decoded tokens.
    assert_eq!(capacity[0]["longest_context"], 8189);
    assert_eq!(capacity[0]["bound_by"], "positions");

    let rows = r["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 8);
    for row in rows {
        let f = |k: &str| row[k].as_f64().unwrap_or_else(|| panic!("{k} in {row}"));
        assert!(f("prefill_tokens_per_s") > 0.0 && f("prefill_tflops_per_device") > 0.0);
        assert!(f("ttft_s") >= f("fill_s"), "{row}");
        assert!(f("total_s") > f("ttft_s"), "{row}");
        assert!(f("decode_ms_per_token") > 0.0);
        assert!(row["peak_bytes"].as_u64().unwrap() > 500 << 20, "{row}");
        let merged = row["ranks"] == 2 && row["strategy"] != "ring";
        assert_eq!(row["merge_ms_per_layer"].is_f64(), merged, "{row}");
    }
    let table1 = r["table1"].as_array().unwrap();
    assert_eq!(
        table1.len(),
        4,
        "tree against ring at each context and rank count"
    );
    for pair in table1 {
        let ratio = pair["ring_s"].as_f64().unwrap() / pair["tree_s"].as_f64().unwrap();
        assert!((pair["speedup"].as_f64().unwrap() - ratio).abs() < 1e-9);
    }
    assert_eq!(
        (table1[3]["context"].as_u64(), table1[3]["ranks"].as_u64()),
        (Some(128), Some(2))
    );

    let text = std::fs::read_to_string(&csv).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 1 + 8, "a header and a line per row");
    assert!(lines[0].starts_with("model,backend,dtype,"), "{}", lines[0]);
    assert!(lines[0].contains(",ttft_s,") && lines[0].contains(",merge_ms_per_layer,"));
    if font() {
        assert!(
            std::fs::metadata(&plot).unwrap().len() > 1000,
            "the plot is drawn"
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_context_beyond_the_memory_is_refused_with_the_numbers() {
    // 2 GiB of address space hold some 40K tokens of f32 KV (45 KiB a token), not 1M.
    let canopy = assert_cmd::cargo::cargo_bin("canopy");
    let mut limited = std::process::Command::new("sh");
    limited
        .args(["-c", "ulimit -v 2097152 && exec \"$0\" \"$@\""])
        .arg(canopy)
        .args([
            "bench",
            "decode",
            "--backend",
            "cpu",
            "--arch",
            "smollm2-135m",
        ])
        .args([
            "--random-weights",
            "--context",
            "1M",
            "--context-fill",
            "random",
        ]);
    Command::from_std(limited)
        .assert()
        .failure()
        .stderr(contains(
            "a context of 1048576 tokens at 1 rank(s) (random) does not fit",
        ))
        .stderr(contains("GiB of host memory"))
        .stderr(
            predicates::str::is_match(r"the longest context that fits is \d{4,5} tokens").unwrap(),
        );
}
