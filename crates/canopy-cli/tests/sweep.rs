//! `canopy bench tree --sweep`: random trees, every method checked, `auto`'s regret summarized.

mod common;

use common::{canopy, json_output};
use predicates::str::contains;

#[test]
fn a_tiny_cpu_sweep_checks_every_method_and_summarizes_auto() {
    let v = json_output(canopy().args([
        "bench",
        "tree",
        "--sweep",
        "3",
        "--seed",
        "7",
        "--heads-configs",
        "4/2x64",
        "--backend",
        "cpu",
        "--iterations",
        "1",
        "--json",
    ]));
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 3);
    for r in rows {
        let name = r["workload"].as_str().unwrap();
        assert!(name.contains("-s7-i"), "{name}");
        assert_eq!(
            (r["q_heads"].as_u64(), r["kv_heads"].as_u64()),
            (Some(4), Some(2))
        );
        let methods = r["methods"].as_array().unwrap();
        assert_eq!(methods.len(), 6, "{name}");
        for m in methods {
            assert!(m["rel_error"].as_f64().unwrap() < 2e-3, "{name}: {m}");
        }
        assert!(r["auto_choice"].is_string(), "{name}");
        assert!(r["auto_vs_best"].as_f64().unwrap() > 0.0, "{name}");
    }
    let s = &v["summary"];
    assert_eq!(s["rows"].as_u64(), Some(3));
    let share = s["within_1_05_of_best"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&share), "{s}");
    assert!(s["worst_auto_vs_best"].as_f64().unwrap() > 0.0, "{s}");
    assert!(s["worst_auto_vs_q_guided"].as_f64().unwrap() > 0.0, "{s}");
    assert!(
        s["geomean_speedup_vs_q_guided"].as_f64().unwrap() > 0.0,
        "{s}"
    );
    assert!(s["max_rel_error"].as_f64().unwrap() < 2e-3, "{s}");
}

#[test]
fn sweep_arguments_are_checked() {
    canopy()
        .args([
            "bench",
            "tree",
            "--sweep",
            "2",
            "--heads-configs",
            "30/8x128",
        ])
        .args(["--backend", "cpu"])
        .assert()
        .failure()
        .stderr(contains("30/8x128"));
    canopy()
        .args(["bench", "tree", "--sweep", "2", "--workload", "fasttree-0"])
        .assert()
        .failure()
        .stderr(contains("cannot be used with"));
    canopy()
        .args(["bench", "tree", "--sweep", "2", "--method", "fasttree,auto"])
        .args(["--backend", "cpu"])
        .assert()
        .failure()
        .stderr(contains("must include both"));
    canopy()
        .args(["bench", "tree"])
        .assert()
        .failure()
        .stderr(contains("--workload"));
    canopy()
        .args(["bench", "tree", "--workload", "fasttree-0", "--ranks", "2"])
        .args(["--auto-timed", "--backend", "cpu"])
        .assert()
        .failure()
        .stderr(contains("--auto-timed times one rank"));
}

/// `auto` settled by the clock runs a plan of one of its candidates, checked like the rest.
#[test]
fn a_sweep_with_auto_timed_checks_its_plans() {
    let v = json_output(canopy().args([
        "bench",
        "tree",
        "--sweep",
        "2",
        "--seed",
        "3",
        "--heads-configs",
        "4/1x64",
        "--backend",
        "cpu",
        "--iterations",
        "1",
        "--auto-timed",
        "--json",
    ]));
    for r in v["rows"].as_array().unwrap() {
        let auto = r["methods"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["method"] == "auto")
            .expect("an auto row");
        assert!(auto["rel_error"].as_f64().unwrap() < 2e-3, "{auto}");
        assert!(auto["chosen"].is_string(), "{auto}");
    }
}

/// A tiny CPU sweep's JSON, saved under the system's temporary folder.
fn sweep_file(seed: &str) -> std::path::PathBuf {
    let out = canopy()
        .args(["bench", "tree", "--sweep", "2", "--seed", seed])
        .args(["--heads-configs", "4/2x64", "--backend", "cpu"])
        .args(["--iterations", "1", "--check", "false", "--json"])
        .assert()
        .success()
        .get_output()
        .stdout
        .clone();
    let path =
        std::env::temp_dir().join(format!("canopy-sweep-{}-s{seed}.json", std::process::id()));
    std::fs::write(&path, out).unwrap();
    path
}

#[test]
fn fit_model_reads_sweeps_and_judges_a_disjoint_holdout() {
    let (fit, held) = (sweep_file("21"), sweep_file("22"));
    let v = json_output(
        canopy()
            .arg("fit-model")
            .arg(&fit)
            .arg("--holdout")
            .arg(&held)
            .arg("--json"),
    );
    assert_eq!(v["trees"].as_array().unwrap().len(), 2);
    assert_eq!(v["samples"].as_u64(), Some(10), "five methods on two trees");
    let h = &v["holdout"];
    assert_eq!(h["samples"].as_u64(), Some(10), "{h}");
    for k in ["log_error", "regret", "worst_regret", "within_1_05"] {
        assert!(h["fitted"][k].as_f64().unwrap() >= 0.0, "{k}: {h}");
    }
    assert!(
        h["start"]["slower_than_q_guided"].as_u64().unwrap() <= 2,
        "{h}"
    );
    // The clock settles among plans that include the model's pick and q-guided: it picks no
    // worse, and never slower than q-guided.
    for score in [&v, h] {
        for (model, clock) in [("start", "start_clock"), ("fitted", "fitted_clock")] {
            let (m, c) = (&score[model], &score[clock]);
            let f = |p: &serde_json::Value, k: &str| p[k].as_f64().unwrap();
            assert!(f(c, "regret") <= f(m, "regret"), "{score}");
            assert!(f(c, "within_1_05") >= f(m, "within_1_05"), "{score}");
            assert_eq!(c["slower_than_q_guided"].as_u64(), Some(0), "{score}");
            assert!(f(c, "timed_per_tree") >= 0.0, "{score}");
        }
    }
    // Fitted to its picks, the model's regret is reported on both sets.
    let v = json_output(
        canopy()
            .args(["fit-model", "--objective", "picks", "--json"])
            .arg(&fit)
            .arg("--holdout")
            .arg(&held),
    );
    for score in [&v, &v["holdout"]] {
        assert!(
            score["fitted"]["regret"].as_f64().unwrap() >= 1.0,
            "{score}"
        );
    }
    canopy()
        .arg("fit-model")
        .arg(&fit)
        .arg("--holdout")
        .arg(&fit)
        .assert()
        .failure()
        .stderr(contains("disjoint"));
    for p in [fit, held] {
        let _ = std::fs::remove_file(p);
    }
}
