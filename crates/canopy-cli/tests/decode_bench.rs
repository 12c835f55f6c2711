//! `canopy bench decode` on the CPU: a real model prefilled and a preset shape with random
//! weights and a random context, every rank count and strategy reported, bad requests refused.

mod common;

use assert_cmd::Command;
use common::{canopy, font};
use predicates::str::contains;
use serde_json::Value;

/// The JSON a command that succeeds prints.
fn json_of(cmd: &mut Command) -> Value {
    let out = cmd.assert().success().get_output().stdout.clone();
    serde_json::from_slice(&out).expect("JSON")
}

fn report(args: &[&str]) -> Value {
    json_of(
        canopy()
            .args(["bench", "decode", "--backend", "cpu", "--json"])
            .args(args),
    )
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
    // The table says so too.
    let model = common::tiny_model("gqa-hd64");
    canopy()
        .args(["bench", "decode", "--backend", "cpu", "--model", &model])
        .args([
            "--context",
            "64",
            "--context-fill",
            "random",
            "--decode",
            "2",
        ])
        .assert()
        .success()
        .stdout(contains(
            "the context's KV was filled at random, not prefilled",
        ));
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

/// A saved GPU run whose steps a known model made: one rank reads the weights and its KV at
/// 4 TB/s plus 1.5 ms; the tree adds 0.6 + 0.05 ms per peer; the ring 2 ms per peer plus each
/// shard at 250 GB/s.
fn modelled_run(ranks: &[usize], contexts: &[usize]) -> Value {
    let (weights, copy_gb_s, kv_per_token) = (16e9, 4000.0, 131072.0);
    let mut rows = Vec::new();
    for &p in ranks {
        for &n in contexts {
            let kv = n as f64 * kv_per_token / p as f64;
            let alone = 1.5 + (weights + kv) / 4e12 * 1e3;
            let peers = (p - 1) as f64;
            for (strategy, ms) in [
                (
                    "tree/auto",
                    alone + if p > 1 { 0.6 + 0.05 * peers } else { 0.0 },
                ),
                ("ring", alone + peers * (2.0 + kv / 250e9 * 1e3)),
            ] {
                rows.push(serde_json::json!({
                    "context": n, "ranks": p, "strategy": strategy, "decode_ms_per_token": ms,
                    "floor_ms": (weights + kv) / (copy_gb_s * 1e9) * 1e3,
                }));
            }
        }
    }
    serde_json::json!({
        "model": "llama-3.1-8b", "weight_bytes": weights as u64,
        "copy_bandwidth_gb_s": copy_gb_s, "rows": rows,
    })
}

fn predict(dir: &std::path::Path, runs: &[Value], args: &[&str]) -> Command {
    std::fs::create_dir_all(dir).unwrap();
    let files: Vec<String> = runs
        .iter()
        .enumerate()
        .map(|(i, run)| {
            let path = dir.join(format!("run{i}.json"));
            std::fs::write(&path, run.to_string()).unwrap();
            path.display().to_string()
        })
        .collect();
    let mut cmd = canopy();
    cmd.args(["bench", "decode", "--from", &files.join(",")])
        .args(args);
    cmd
}

/// The JSON of a prediction that succeeds.
fn predicted(dir: &std::path::Path, runs: &[Value], args: &[&str]) -> Value {
    json_of(predict(dir, runs, args).arg("--json"))
}

#[test]
fn predictions_at_more_ranks_follow_the_runs_model() {
    let dir = std::env::temp_dir().join(format!("canopy-decode-predict-{}", std::process::id()));
    let runs = [
        modelled_run(&[1, 2], &[32 << 10, 128 << 10]),
        modelled_run(&[4], &[32 << 10, 128 << 10, 1 << 20]),
    ];
    let r = predicted(&dir, &runs, &["--predict", "8", "--context", "4M"]);
    let rows = r["rows"].as_array().unwrap();
    // Two strategies at four contexts: the three measured and 4M.
    assert_eq!(rows.len(), 8);
    for row in rows {
        let n = row["context"].as_f64().unwrap();
        let kv = n * 131072.0 / 8.0;
        let alone = 1.5 + (16e9 + kv) / 4e12 * 1e3;
        let want = match row["strategy"].as_str().unwrap() {
            "tree/auto" => alone + 0.6 + 0.05 * 7.0,
            _ => alone + 7.0 * (2.0 + kv / 250e9 * 1e3),
        };
        let got = row["predicted_ms"].as_f64().unwrap();
        assert!((got - want).abs() < 1e-6 * want, "{row}: {got} vs {want}");
        assert!(row["measured_ms"].is_null());
    }
    // Predicting a measured count fits the rows below it and sets the measurement beside. One
    // rank count past one fits the ring's hand-off exactly, and the tree's merges as flat: the
    // 2-rank merge (0.65 ms) where 4 ranks take 0.75.
    let r = predicted(&dir, &runs, &["--predict", "4"]);
    for row in r["rows"].as_array().unwrap() {
        let (got, measured) = (
            row["predicted_ms"].as_f64().unwrap(),
            row["measured_ms"].as_f64().unwrap(),
        );
        let want = match row["strategy"].as_str().unwrap() {
            "tree/auto" => measured - 0.1,
            _ => measured,
        };
        assert!((got - want).abs() < 1e-6 * want, "{row}");
        assert!((row["error"].as_f64().unwrap() - (got - measured) / measured).abs() < 1e-12);
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// Rows whose ranks shared a GPU took turns on it: a prediction neither fits them nor sets
/// them beside its rows as measured.
#[test]
fn rows_of_ranks_sharing_a_gpu_are_not_fitted() {
    let dir = std::env::temp_dir().join(format!("canopy-decode-shared-{}", std::process::id()));
    let contexts = [32 << 10, 128 << 10];
    let mut shared = modelled_run(&[4], &contexts);
    for row in shared["rows"].as_array_mut().unwrap() {
        row["ranks_per_device"] = 4.into();
        row["decode_ms_per_token"] = (10.0 * row["decode_ms_per_token"].as_f64().unwrap()).into();
    }
    let alone = predicted(
        &dir,
        &[modelled_run(&[1, 2], &contexts)],
        &["--predict", "4"],
    );
    let beside = predicted(
        &dir,
        &[modelled_run(&[1, 2], &contexts), shared],
        &["--predict", "4"],
    );
    assert_eq!(beside["rows"], alone["rows"]);
    assert!(beside["rows"]
        .as_array()
        .unwrap()
        .iter()
        .all(|row| row["measured_ms"].is_null()));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn predictions_need_gpu_runs_at_several_ranks() {
    let dir = std::env::temp_dir().join(format!(
        "canopy-decode-unpredictable-{}",
        std::process::id()
    ));
    let mut cpu = modelled_run(&[1, 2], &[1024, 2048]);
    cpu["copy_bandwidth_gb_s"] = Value::Null;
    predict(&dir, &[cpu], &["--predict", "4"])
        .assert()
        .failure()
        .stderr(contains("predict from GPU runs"));
    let alone = modelled_run(&[1], &[1024, 2048]);
    predict(&dir, &[alone], &["--predict", "4"])
        .assert()
        .failure()
        .stderr(contains("no rows on 2 to 3 ranks"));
    predict(
        &dir,
        &[modelled_run(&[1, 2], &[1024, 2048])],
        &["--predict", "2"],
    )
    .assert()
    .failure()
    .stderr(contains("3 ranks or more"));
    canopy()
        .args(["bench", "decode", "--predict", "4"])
        .assert()
        .failure()
        .stderr(contains("--from"));
    std::fs::remove_dir_all(&dir).ok();
}
