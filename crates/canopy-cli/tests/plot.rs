//! `canopy bench scaling --plot`: a bad plot path is refused before any benchmark runs, and a
//! saved `--json` is drawn as PNG and SVG.

mod common;

use common::{canopy, font};
use predicates::prelude::*;
use predicates::str::contains;
use serde_json::json;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// A fresh directory of this test's own under the system's temporary one.
fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("canopy-plot-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A 256K-token sweep on the CPU runs for minutes: failing within seconds shows that the
/// plot path is checked first.
const SLOW: [&str; 10] = [
    "bench",
    "scaling",
    "--backend",
    "cpu",
    "--ranks",
    "1,2,4",
    "--seq-lens",
    "262144",
    "--iters",
    "5",
];

#[test]
fn an_unsupported_plot_extension_fails_before_benchmarking() {
    let start = Instant::now();
    canopy()
        .args(SLOW)
        .args(["--plot", "scaling.jpg"])
        .timeout(Duration::from_secs(60))
        .assert()
        .failure()
        .stderr(contains("--plot scaling.jpg").and(contains("name it .png or .svg")));
    let took = start.elapsed();
    assert!(took < Duration::from_secs(5), "took {took:?}");
}

#[test]
fn a_plot_in_a_missing_directory_fails_before_benchmarking() {
    let missing = temp_dir("missing").join("no-such-dir").join("scaling.png");
    let start = Instant::now();
    canopy()
        .args(SLOW)
        .args(["--plot", missing.to_str().unwrap()])
        .timeout(Duration::from_secs(60))
        .assert()
        .failure()
        .stderr(contains("does not exist"));
    let took = start.elapsed();
    assert!(took < Duration::from_secs(5), "took {took:?}");
}

fn row(strategy: &str, ranks: usize, seq_len: u32, median_ms: f64) -> serde_json::Value {
    json!({
        "strategy": strategy,
        "ranks": ranks,
        "seq_len": seq_len,
        "batch": 1,
        "median_ms": median_ms,
        "p10_ms": median_ms * 0.95,
        "p90_ms": median_ms * 1.05,
        "kv_bytes_per_rank": seq_len as u64 * 8192 / ranks as u64,
        "comm_bytes_per_rank": 0,
        "paper_comm_bytes": 0,
        "peak_mem_bytes": null,
        "paper_mem_bytes": 0,
        "link_gbps": null,
        "rel_error": 1e-7,
    })
}

#[test]
fn a_saved_run_is_drawn_as_png_and_svg() {
    let dir = temp_dir("from");
    let mut rows = Vec::new();
    for n in [4096u32, 16384, 65536] {
        for p in [1usize, 2, 4] {
            let local = n as f64 / 4096.0 / p as f64;
            rows.push(row("tree/allreduce2", p, n, local * 1.1));
            rows.push(row("tree/allgather", p, n, local));
            rows.push(row("tree/auto (allgather)", p, n, local));
            rows.push(row("ring", p, n, local * p as f64 * 3.0));
        }
    }
    let saved = dir.join("scaling.json");
    let doc = json!({
        "backend": "cpu",
        "q_heads": 16,
        "kv_heads": 16,
        "head_dim": 128,
        "dtype": "bf16",
        "iters": 2,
        "rows": rows,
    });
    std::fs::write(&saved, doc.to_string()).unwrap();
    for (name, magic) in [("scaling.png", &b"\x89PNG"[..]), ("scaling.svg", b"<svg")] {
        let out = dir.join(name);
        let _ = std::fs::remove_file(&out);
        let assert = canopy()
            .args(["bench", "scaling", "--from", saved.to_str().unwrap()])
            .args(["--plot", out.to_str().unwrap()])
            .assert();
        if !font() {
            assert.failure().stderr(contains("CANOPY_FONT"));
            continue;
        }
        assert.success().stdout(contains("ring / tree"));
        let bytes = std::fs::read(&out).unwrap();
        assert!(bytes.len() > 10_000, "{name}: {} bytes", bytes.len());
        assert!(
            bytes.windows(magic.len()).take(200).any(|w| w == magic),
            "{name} is not a {} file",
            &name[name.len() - 3..]
        );
    }
}
