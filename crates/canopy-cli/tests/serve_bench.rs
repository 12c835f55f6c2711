//! `canopy bench serve` on the CPU: against a server it starts itself (the tiny fixture model,
//! and a preset shape with random weights) and against `canopy serve` at a URL; the report's
//! counts, latencies and throughputs agree with each other and with what was asked, requests
//! that share a prefix find it cached, and `--max-concurrency` bounds the server's batch.

mod common;

use assert_cmd::Command;
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::process::Stdio;

fn tiny() -> String {
    common::tiny_model("gqa-hd64")
}

fn bench(args: &[&str]) -> Value {
    let out = Command::cargo_bin("canopy")
        .expect("the canopy binary is built")
        .args(["bench", "serve", "--json"])
        .args(args)
        .assert()
        .success()
        .get_output()
        .stdout
        .clone();
    serde_json::from_slice(&out).expect("JSON")
}

fn num(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("a number, not {v}"))
}

/// What every report holds: `n` requests all completed, each with `output_len` tokens (the
/// requests ignore EOS), latencies that are positive and ordered, throughputs that agree.
fn check_consistent(r: &Value, n: usize, output_len: usize) {
    assert_eq!(r["requests"], n);
    assert_eq!(r["completed"], n, "{r}");
    assert_eq!(r["failed"], 0);
    assert_eq!(r["output_tokens"], n * output_len);
    let duration = num(&r["duration_s"]);
    assert!(duration > 0.0);
    let throughput = num(&r["output_throughput"]);
    assert!((throughput * duration - (n * output_len) as f64).abs() < 1e-6 * throughput);
    assert!(num(&r["request_throughput"]) > 0.0);
    assert!(num(&r["total_token_throughput"]) > throughput);
    for name in ["ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"] {
        let s = &r[name];
        assert!(num(&s["mean"]) > 0.0, "{name}: {s}");
        assert!(num(&s["median"]) <= num(&s["p99"]), "{name}: {s}");
    }
    assert!(num(&r["e2e_ms"]["median"]) >= num(&r["ttft_ms"]["median"]));
    assert!(num(&r["e2e_ms"]["p99"]) <= duration * 1e3);
    let steps = &r["steps"];
    let shares = ["decode_share", "prefill_share", "other_share"].map(|k| num(&steps[k]));
    assert!((shares.iter().sum::<f64>() - 1.0).abs() < 1e-9, "{steps}");
    assert!(
        shares[0] > 0.0 && shares[1] > 0.0 && shares[2] > 0.0,
        "{steps}"
    );
    assert!(num(&steps["prefill_tokens"]) > 0.0 && num(&steps["mean_step_ms"]) > 0.0);
    let decode = &r["decode"];
    assert!(num(&decode["passes"]) > 0.0);
    assert!(num(&decode["weight_bytes"]) > 0.0);
    // The CPU has no copy bandwidth measured: no floor.
    assert!(decode["copy_bandwidth_gb_s"].is_null());
    for p in decode["by_rows"].as_array().unwrap() {
        assert!(num(&p["mean_ms"]) > 0.0 && num(&p["mean_kv_bytes"]) > 0.0);
        assert!(p["floor_ms"].is_null());
    }
}

#[test]
fn a_shared_prefix_is_found_cached_by_the_requests_behind_it() {
    let r = bench(&[
        "--model",
        &tiny(),
        "--backend",
        "cpu",
        "--dataset",
        "few-shot",
        "--prefix-len",
        "96",
        "--question-len",
        "12",
        "--output-len",
        "10",
        "--num-prompts",
        "10",
        "--max-batch",
        "8",
        "--prefill-chunk",
        "48",
    ]);
    check_consistent(&r, 10, 10);
    assert_eq!(r["server"], "in-process");
    assert_eq!(r["dataset"]["dataset"], "few-shot");
    assert_eq!(r["prompt_tokens"], 10 * 108);
    // The first request computes the prefix; the nine behind it read its 96 tokens (six
    // pages) from the cache, even those that arrived with it.
    let rate = num(&r["prefix_cache_hit_rate"]);
    assert!((rate - 9.0 * 96.0 / (10.0 * 107.0)).abs() < 1e-9, "{rate}");
    assert!((num(&r["cached_prompt_share"]) - 9.0 * 96.0 / 1080.0).abs() < 1e-9);
}

/// Draws at a temperature (as OpenAI's clients send them) complete every request, and the
/// report says how they were drawn.
#[test]
fn sampled_requests_are_drawn_as_asked() {
    let r = bench(&[
        "--model",
        &tiny(),
        "--backend",
        "cpu",
        "--dataset",
        "random",
        "--input-len",
        "24",
        "--output-len",
        "8",
        "--num-prompts",
        "6",
        "--temperature",
        "1",
        "--top-p",
        "0.9",
    ]);
    check_consistent(&r, 6, 8);
    assert_eq!(r["sampling"]["temperature"], 1.0);
    assert!((num(&r["sampling"]["top_p"]) - 0.9).abs() < 1e-6);
    assert_eq!(r["sampling"]["top_k"], 0);
}

#[test]
fn a_shape_with_random_weights_is_served_with_its_stand_in_tokenizer() {
    let r = bench(&[
        "--arch",
        "smollm2-135m",
        "--random-weights",
        "--backend",
        "cpu",
        "--max-context",
        "512",
        "--dataset",
        "multi-chain",
        "--prefix-len",
        "32",
        "--branching",
        "2",
        "--depth",
        "1",
        "--step-len",
        "32",
        "--question-len",
        "4",
        "--output-len",
        "4",
        "--num-prompts",
        "4",
    ]);
    check_consistent(&r, 4, 4);
    assert_eq!(r["model"], "smollm2-135m");
    assert!(num(&r["prefix_cache_hit_rate"]) > 0.0);
}

#[test]
fn a_server_at_a_url_takes_the_load_at_most_max_concurrency_at_a_time() {
    let mut server = std::process::Command::new(assert_cmd::cargo::cargo_bin("canopy"))
        .args([
            "serve",
            "--model",
            &tiny(),
            "--backend",
            "cpu",
            "--port",
            "0",
        ])
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .expect("canopy serve starts");
    let mut lines = BufReader::new(server.stderr.take().unwrap()).lines();
    let url = loop {
        let line = lines
            .next()
            .expect("the server says where it listens")
            .unwrap();
        if let Some(rest) = line.split("listening on ").nth(1) {
            break rest.split_whitespace().next().unwrap().to_string();
        }
    };
    std::thread::spawn(move || lines.for_each(drop));
    let r = bench(&[
        "--url",
        &url,
        "--dataset",
        "random",
        "--input-len",
        "20",
        "--output-len",
        "6",
        "--num-prompts",
        "8",
        "--request-rate",
        "200",
        "--max-concurrency",
        "2",
        "--seed",
        "3",
    ]);
    let _ = server.kill();
    let _ = server.wait();
    check_consistent(&r, 8, 6);
    assert_eq!(r["server"], url);
    assert_eq!(r["request_rate"], 200.0);
    let rows: Vec<u64> = r["decode"]["by_rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["rows"].as_u64().unwrap())
        .collect();
    assert!(rows.iter().all(|&n| n <= 2), "batch sizes {rows:?}");
}
