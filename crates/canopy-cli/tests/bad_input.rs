//! Inputs a new user types that once crashed canopy or did something silently wrong: each
//! ends in a clear error and a non-zero exit, or in what the user meant.
//!
//! The cases that used to exhaust memory run under an address-space limit (`ulimit -v`), so a
//! regression fails the test instead of the machine.

mod common;

use assert_cmd::Command;
use common::canopy;
use predicates::prelude::*;
use predicates::str::contains;
use std::time::{Duration, Instant};

/// The address space the memory cases may use: far below what they would have allocated.
const LIMIT_KIB: u64 = 4 << 20;

/// `canopy ARGS` under `ulimit -v LIMIT_KIB`.
fn limited(args: &str) -> Command {
    let bin = assert_cmd::cargo::cargo_bin("canopy");
    let mut cmd = Command::new("sh");
    cmd.arg("-c").arg(format!(
        "ulimit -v {LIMIT_KIB} && exec '{}' {args}",
        bin.display()
    ));
    cmd.timeout(Duration::from_secs(60));
    cmd
}

#[test]
fn a_hundred_thousand_ranks_are_refused_before_anything_runs() {
    limited("bench attention --backend cpu --ranks 100000")
        .assert()
        .failure()
        .stderr(contains("--ranks 100000"))
        .stderr(contains("at most 32768 ranks"));
    // Enough tokens for every rank: the ranks' buffers are what cannot fit.
    limited("bench attention --backend cpu --ranks 100000 --seq-len 1000000 --strategy tree")
        .assert()
        .failure()
        .stderr(contains("GiB of host memory"));
}

#[test]
fn a_thousand_thread_ranks_are_priced_their_passes_beside_their_kv() {
    // Their KV (2.1 GiB) fits the limit; with every rank's activations, logits and heap it
    // does not.
    limited(
        "generate --arch smollm2-135m --random-weights --prompt hi --max-tokens 4 --ranks 1000",
    )
    .assert()
    .failure()
    .stderr(contains("1000 rank(s)' passes and heaps"))
    .stderr(contains("fewer ranks"))
    .stderr(contains("memory allocation").not());
}

#[test]
fn a_context_beyond_host_memory_is_refused_with_both_sizes() {
    let t0 = Instant::now();
    limited("bench attention --backend cpu --seq-len 100000000")
        .assert()
        .failure()
        .stderr(contains("GiB of host memory but"))
        .stderr(contains("GiB are available"))
        .stderr(contains("memory allocation").not());
    assert!(
        t0.elapsed() < Duration::from_secs(20),
        "refused before work"
    );
}

#[test]
fn the_address_space_limit_counts_as_unavailable_memory() {
    // About 9 GiB in all: within this machine's memory, beyond the 4 GiB the limit allows.
    limited("bench attention --backend cpu --seq-len 262144 --ranks 2 --strategy ring")
        .assert()
        .failure()
        .stderr(contains("GiB of host memory"));
}

#[test]
fn a_tree_bench_beyond_host_memory_is_refused() {
    limited("bench tree --workload long --seq-len 400000000 --backend cpu --method q-guided")
        .assert()
        .failure()
        .stderr(contains("GiB of host memory"));
}

#[test]
fn planning_more_ranks_than_tokens_is_refused_not_an_empty_table() {
    canopy()
        .args(["plan", "--workload", "fasttree-4", "--ranks", "100000"])
        .assert()
        .failure()
        .stderr(contains("at most 34816 ranks"));
    canopy()
        .args([
            "bench",
            "tree",
            "--workload",
            "fasttree-0",
            "--ranks",
            "5000",
        ])
        .args(["--backend", "cpu"])
        .assert()
        .failure()
        .stderr(contains("at most"));
}

#[test]
fn zero_iterations_and_zero_lengths_are_refused_by_the_parser() {
    for args in [
        &["bench", "attention", "--backend", "cpu", "--iters", "0"][..],
        &[
            "bench",
            "tree",
            "--workload",
            "fasttree-0",
            "--iterations",
            "0",
        ],
        &["bench", "kernel", "--iters", "0"],
        &["bench", "attention", "--backend", "cpu", "--seq-len", "0"],
        &[
            "bench",
            "scaling",
            "--backend",
            "cpu",
            "--seq-lens",
            "4096,0",
        ],
    ] {
        canopy()
            .args(args)
            .assert()
            .failure()
            .stderr(contains("invalid value '0'"));
    }
    // The range in the message starts at 1.
    canopy()
        .args(["bench", "attention", "--seq-len", "0"])
        .assert()
        .failure()
        .stderr(contains("0..=").not());
}

/// Sampling settings outside their range are refused by the parser, as the server refuses
/// them with a 400, instead of decoding as if another value had been given.
#[test]
fn sampling_settings_out_of_range_are_refused_by_the_parser() {
    let model = &common::tiny_model("llama3-hd128");
    for (flag, value, why) in [
        ("--temperature", "-1", "at least 0"),
        ("--temperature", "inf", "at least 0"),
        ("--top-p", "0", "more than 0"),
        ("--top-p", "1.5", "at most 1"),
        ("--stop", "", "must not be empty"),
    ] {
        canopy()
            .args(["generate", "--model", model, "--prompt", "hi", flag, value])
            .assert()
            .failure()
            .stderr(contains(format!("invalid value '{value}'")).and(contains(why)));
    }
    // `bench serve` holds its requests to the API's range, which a server would refuse past.
    canopy()
        .args([
            "bench",
            "serve",
            "--url",
            "http://127.0.0.1:9",
            "--temperature",
            "5",
        ])
        .assert()
        .failure()
        .stderr(contains("invalid value '5'").and(contains("at most 2")));
}

/// A server that could admit no request, or not one of its longest context, is refused at
/// start with the numbers, before it loads the model's weights onto a device.
#[test]
fn a_server_that_could_admit_no_request_is_refused_at_start() {
    let model = &common::tiny_model("llama3-hd128");
    let serve = |extra: &[&str]| {
        let mut cmd = canopy();
        cmd.args(["serve", "--model", model, "--port", "0"])
            .args(extra)
            .timeout(Duration::from_secs(60));
        cmd
    };
    serve(&["--max-context", "1"])
        .assert()
        .failure()
        .stderr(contains("--max-context 1 leaves no room"));
    serve(&["--max-context", "64", "--kv-tokens", "16"])
        .assert()
        .failure()
        .stderr(contains(
            "--kv-tokens 16 holds less than one request of --max-context 64",
        ));
}

#[test]
fn bench_attention_help_gives_every_option_a_description_and_its_default() {
    let out = canopy()
        .args(["bench", "attention", "--help"])
        .assert()
        .success()
        .get_output()
        .stdout
        .clone();
    let help = String::from_utf8(out).unwrap();
    for flag in ["--heads", "--kv-heads", "--head-dim", "--dtype"] {
        let line = help
            .lines()
            .skip_while(|l| !l.trim_start().starts_with(flag))
            .take(3)
            .collect::<String>();
        assert!(line.contains("default"), "{flag}: {line}");
    }
    for flag in ["--iters", "--warmup", "--seed", "--json"] {
        let line = help
            .lines()
            .find(|l| l.trim_start().starts_with(flag))
            .unwrap_or_else(|| panic!("{flag} is listed"));
        let described = line.split_whitespace().count() > 2;
        let next = help
            .lines()
            .skip_while(|l| !l.trim_start().starts_with(flag))
            .nth(1)
            .unwrap_or("");
        assert!(
            described || !next.trim_start().starts_with("--"),
            "{flag} has no description: {line}"
        );
    }
}

/// `bench tree` on the CPU over a small shape of the first FastTree workload, one iteration of
/// each of `methods`.
fn small_tree_bench_on_cpu(methods: &str) -> Command {
    let mut cmd = canopy();
    cmd.args([
        "bench",
        "tree",
        "--workload",
        "fasttree-0",
        "--backend",
        "cpu",
    ])
    .args(["--heads", "4", "--kv-heads", "2", "--head-dim", "64"])
    .args(["--method", methods, "--iterations", "1"]);
    cmd
}

#[test]
fn bench_tree_on_the_cpu_shows_no_gpu_prediction_or_cache_state() {
    let out = small_tree_bench_on_cpu("q-guided,auto")
        .assert()
        .success()
        .get_output()
        .stdout
        .clone();
    let text = String::from_utf8(out).unwrap();
    assert!(!text.contains("L2"), "{text}");
    assert!(!text.contains("model"), "{text}");
    assert!(text.contains("µs") && !text.contains(" us"), "{text}");
    assert!(text.contains("auto ("), "auto names its choice: {text}");
}

#[test]
fn plan_names_autos_choice_in_the_table_and_the_json() {
    canopy()
        .args(["plan", "--workload", "fasttree-8"])
        .assert()
        .success()
        .stdout(predicate::str::is_match(r"auto \((q-guided|deft-[a-z-]+|fasttree)\)").unwrap())
        .stdout(contains("model µs"));
    let out = canopy()
        .args([
            "plan",
            "--workload",
            "fasttree-8",
            "--method",
            "auto",
            "--json",
        ])
        .assert()
        .success()
        .get_output()
        .stdout
        .clone();
    let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
    assert!(v["methods"][0]["chosen"].is_string(), "{v}");
}

#[test]
fn a_reader_that_stops_early_ends_the_output_without_a_panic() {
    // The reader closes its end before canopy has planned, so every write meets a closed pipe.
    let bin = assert_cmd::cargo::cargo_bin("canopy");
    Command::new("sh")
        .arg("-c")
        .arg(format!(
            "'{}' plan --workload fasttree-8 | {{ exec 0<&-; sleep 1; }}",
            bin.display()
        ))
        .assert()
        .success()
        .stderr(contains("panicked").not());
}

/// A bad value in a workload file is reported at its own line, with the file's text there.
#[test]
fn a_workload_files_bad_value_is_reported_at_its_line() {
    let path = std::env::temp_dir().join(format!("canopy-bad-{}.toml", std::process::id()));
    std::fs::write(
        &path,
        "[shape]\nq_heads = 4\nkv_heads = 2\nhead_dim = 64\n\n[tree]\nkind = \"long\"\n\
         seq_len = \"abc\"\n",
    )
    .unwrap();
    let run = canopy()
        .args(["plan", "--workload"])
        .arg(&path)
        .assert()
        .failure();
    std::fs::remove_file(&path).unwrap();
    run.stderr(contains("line 8,").and(contains("8 | seq_len = \"abc\"")));
}

/// An option a run has no use for is named in a note with the reason, not silently dropped.
#[test]
fn options_a_run_leaves_unused_are_noted() {
    small_tree_bench_on_cpu("q-guided")
        .args(["--kernel", "mma", "--mma-tile", "64", "--page-size", "16"])
        .assert()
        .success()
        .stderr(contains(
            "note: --kernel and --mma-tile have no effect: the CPU backend runs its own",
        ))
        .stderr(contains("note: --page-size has no effect"));
    let model = &common::tiny_model("llama3-hd128");
    let generate = |extra: &[&str]| {
        let mut cmd = canopy();
        cmd.args([
            "generate",
            "--model",
            model,
            "--prompt",
            "hi",
            "--max-tokens",
            "1",
        ])
        .args(["--backend", "cpu"])
        .args(extra)
        .timeout(Duration::from_secs(60));
        cmd
    };
    generate(&["--seed", "3", "--top-p", "0.9", "--eager"])
        .assert()
        .success()
        .stderr(contains(
            "note: --top-p and --seed have no effect: --temperature 0 (the default) decodes greedily",
        ))
        .stderr(contains("note: --eager has no effect"));
    generate(&[
        "--strategy",
        "ring",
        "--ranks",
        "2",
        "--collective",
        "allgather",
    ])
    .assert()
    .success()
    .stderr(contains("note: --collective has no effect: the ring"));
    generate(&["--n", "2"])
        .assert()
        .success()
        .stderr(contains("note: --n 2 samples decode greedily"));
    generate(&["--collective", "allgather"])
        .assert()
        .success()
        .stderr(contains("note: --collective has no effect: one rank"));
    generate(&["--seed", "3", "--temperature", "0.7"])
        .args(["--ranks", "2", "--collective", "allgather"])
        .assert()
        .success()
        .stderr(contains("no effect").not());
}

/// `bench decode --predict` runs nothing, so the options of a run are refused beside it.
#[test]
fn bench_decode_predict_refuses_the_options_of_a_run() {
    for flag in [
        ["--csv", "rows.csv"],
        ["--plot", "steps.png"],
        ["--ranks", "2"],
    ] {
        canopy()
            .args(["bench", "decode", "--from", "run.json", "--predict", "4"])
            .args(flag)
            .assert()
            .failure()
            .stderr(contains("cannot be used with"));
    }
}
