//! `canopy bench tree --sweep N`: `auto` against every method on random trees (issue 25).
//!
//! `auto`'s device model was fitted on the shipped workloads; a sweep benchmarks it on trees
//! it never saw: N draws of [`canopy_core::random_trees`] under several head configurations,
//! every method on each through `bench tree`'s one-rank bench, and reports how far `auto`'s
//! choice is from the fastest method and from Q-guided.

use crate::bench::{resolve_backend, BackendKind};
use crate::plan_cmd::TreeSummary;
use crate::table::Table;
use crate::tree_cmd::{drop_cpu_predictions, OneRank, TreeArgs};
use anyhow::{bail, Context, Result};
use canopy_core::random_trees::draws;
use canopy_core::stats::geomean;
use canopy_core::{AttnShape, DType, Method, PlannerConfig, WorkloadSpec};
use canopy_engine::tree_bench::MethodRun;
use clap::Args;
use serde::Serialize;

/// The head configurations a sweep runs by default: MHA, GQA 4 and 8, MQA, a wide model, and
/// a head dimension of 64.
const DEFAULT_HEADS: &str = "32/32x128,32/8x128,32/4x128,16/1x128,64/8x128,32/8x64";

/// An auto within this factor of the fastest method counts as a good choice.
const NEAR_BEST: f64 = 1.05;

#[derive(Args)]
pub struct SweepArgs {
    /// Benchmark N random trees (drawn from --seed) under each head configuration instead of
    /// one workload, and report `auto`'s regret against the fastest method and Q-guided.
    #[arg(long, value_name = "N", value_parser = crate::bench::at_least_one,
          conflicts_with_all = ["workload", "grow", "ranks", "seq_len", "batch", "prompt_len"])]
    pub sweep: Option<usize>,
    /// The sweep's head configurations, QHEADS/KVHEADS x HEAD_DIM, comma-separated
    /// [default: 32/32x128,32/8x128,32/4x128,16/1x128,64/8x128,32/8x64].
    #[arg(long, value_name = "LIST", requires = "sweep")]
    pub heads_configs: Option<String>,
}

/// Parses `32/8x128,16/1x128`.
fn parse_heads(list: &str) -> Result<Vec<AttnShape>> {
    list.split(',')
        .map(|item| {
            let item = item.trim();
            let parsed = item.split_once('/').and_then(|(q, rest)| {
                let (kv, d) = rest.split_once('x')?;
                Some((q.parse().ok()?, kv.parse().ok()?, d.parse().ok()?))
            });
            let Some((q_heads, kv_heads, head_dim)) = parsed else {
                bail!("--heads-configs: `{item}` is not QHEADS/KVHEADSxHEAD_DIM, e.g. 32/8x128");
            };
            let shape = AttnShape {
                q_heads,
                kv_heads,
                head_dim,
                scale: None,
            };
            shape
                .validate()
                .with_context(|| format!("--heads-configs: `{item}`"))?;
            Ok(shape)
        })
        .collect()
}

/// One tree under one head configuration.
#[derive(Serialize)]
struct SweepRow {
    #[serde(flatten)]
    tree: TreeSummary,
    /// The method `auto` chose and its measured median.
    auto_choice: Method,
    auto_us: f64,
    /// The fastest concrete method measured.
    best: Method,
    best_us: f64,
    q_guided_us: f64,
    /// `auto_us / best_us`: 1 when `auto` chose the fastest.
    auto_vs_best: f64,
    /// `q_guided_us / auto_us`: above 1 when `auto` beats Q-guided.
    speedup_vs_q_guided: f64,
    /// The largest error against the f64 oracle over every method (with --check).
    max_rel_error: Option<f64>,
    methods: Vec<MethodRun>,
}

/// `auto`'s regret over every row.
#[derive(Serialize)]
struct Summary {
    rows: usize,
    /// Rows where `auto` is within 1.05x of the fastest method, as a share.
    within_1_05_of_best: f64,
    worst_auto_vs_best: f64,
    /// The largest `auto_us / q_guided_us`: above 1 where `auto` loses to Q-guided.
    worst_auto_vs_q_guided: f64,
    geomean_speedup_vs_q_guided: f64,
    max_rel_error: Option<f64>,
}

#[derive(Serialize)]
struct SweepOutput {
    backend: BackendKind,
    device: String,
    seed: u64,
    draws: usize,
    iterations: usize,
    summary: Summary,
    rows: Vec<SweepRow>,
}

fn row(tree: TreeSummary, methods: Vec<MethodRun>) -> Result<SweepRow> {
    let find = |m: Method| methods.iter().find(|r| r.method == m);
    let (Some(auto), Some(q)) = (find(Method::Auto), find(Method::QGuided)) else {
        bail!("a sweep's row lacks auto or q-guided");
    };
    let best = methods
        .iter()
        .filter(|r| r.method != Method::Auto)
        .min_by(|a, b| a.median_us.total_cmp(&b.median_us))
        .expect("q-guided is among them");
    let max_rel_error = methods.iter().filter_map(|r| r.rel_error).reduce(f64::max);
    Ok(SweepRow {
        tree,
        auto_choice: auto.chosen.unwrap_or(Method::Auto),
        auto_us: auto.median_us,
        best: best.method,
        best_us: best.median_us,
        q_guided_us: q.median_us,
        auto_vs_best: auto.median_us / best.median_us,
        speedup_vs_q_guided: q.median_us / auto.median_us,
        max_rel_error,
        methods,
    })
}

fn summarize(rows: &[SweepRow]) -> Summary {
    let n = rows.len().max(1) as f64;
    Summary {
        rows: rows.len(),
        within_1_05_of_best: rows.iter().filter(|r| r.auto_vs_best <= NEAR_BEST).count() as f64 / n,
        worst_auto_vs_best: rows.iter().map(|r| r.auto_vs_best).fold(0.0, f64::max),
        worst_auto_vs_q_guided: rows
            .iter()
            .map(|r| 1.0 / r.speedup_vs_q_guided)
            .fold(0.0, f64::max),
        geomean_speedup_vs_q_guided: geomean(rows.iter().map(|r| r.speedup_vs_q_guided)),
        max_rel_error: rows.iter().filter_map(|r| r.max_rel_error).reduce(f64::max),
    }
}

pub fn run(a: &TreeArgs) -> Result<()> {
    let Some(n) = a.sweep.sweep else {
        bail!("give --workload, or --sweep N for random trees");
    };
    let heads = parse_heads(a.sweep.heads_configs.as_deref().unwrap_or(DEFAULT_HEADS))?;
    let methods = Method::parse_list(&a.method)?;
    if !(methods.contains(&Method::Auto) && methods.contains(&Method::QGuided)) {
        bail!("--sweep compares auto with q-guided: --method must include both");
    }
    let kind = resolve_backend(a.backend)?;
    a.note_unused(kind);
    let one = OneRank::new(a, kind)?;
    // The backends split long groups to fill the device; Q-guided keeps each path whole.
    let planner = PlannerConfig::whole_paths();
    let dtype = a.shape.dtype.unwrap_or(DType::F16);
    let trees = draws(a.seed, n);
    let bar = indicatif::ProgressBar::new((trees.len() * heads.len()) as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} trees, {elapsed} {msg}")
            .expect("a valid template"),
    );
    let mut rows = Vec::new();
    for d in &trees {
        let tree = d.build().with_context(|| d.name.clone())?;
        for &shape in &heads {
            bar.set_message(format!(
                "{}/{}x{}",
                shape.q_heads, shape.kv_heads, shape.head_dim
            ));
            let spec = WorkloadSpec {
                name: d.name.clone(),
                description: String::new(),
                shape,
                dtype,
                tree: d.spec.clone(),
            };
            let mut runs = one
                .bench(a, &spec, &tree, &methods, planner)
                .with_context(|| d.name.clone())?;
            if kind != BackendKind::Cuda {
                drop_cpu_predictions(&mut runs);
            }
            rows.push(row(TreeSummary::new(&spec, &tree), runs)?);
            bar.inc(1);
        }
    }
    bar.finish_and_clear();
    let out = SweepOutput {
        backend: kind,
        device: one.device(),
        seed: a.seed,
        draws: n,
        iterations: a.iterations,
        summary: summarize(&rows),
        rows,
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    let mut t = Table::new(&[
        "tree",
        "heads",
        "queries",
        "tokens",
        "auto",
        "auto µs",
        "best",
        "best µs",
        "q-guided µs",
        "auto / best",
        "vs q-guided",
    ]);
    for r in &out.rows {
        let s = &r.tree;
        t.row(vec![
            s.workload.clone(),
            format!("{}/{}x{}", s.q_heads, s.kv_heads, s.head_dim),
            s.queries.to_string(),
            s.tree_tokens.to_string(),
            r.auto_choice.to_string(),
            format!("{:.1}", r.auto_us),
            r.best.to_string(),
            format!("{:.1}", r.best_us),
            format!("{:.1}", r.q_guided_us),
            format!("{:.2}x", r.auto_vs_best),
            format!("{:.2}x", r.speedup_vs_q_guided),
        ]);
    }
    println!(
        "{n} random trees (seed {}) x {} head configurations on {}",
        a.seed,
        heads.len(),
        out.device
    );
    println!("{}", t.render());
    let s = &out.summary;
    println!(
        "auto within {NEAR_BEST}x of the best in {:.0}% of {} rows, worst {:.2}x; auto / q-guided at worst {:.2}x, geomean speedup over q-guided {:.2}x{}",
        100.0 * s.within_1_05_of_best,
        s.rows,
        s.worst_auto_vs_best,
        s.worst_auto_vs_q_guided,
        s.geomean_speedup_vs_q_guided,
        s.max_rel_error
            .map_or(String::new(), |e| format!("; max rel err {e:.2e}"))
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heads_configs_parse_and_reject_bad_items() {
        let s = parse_heads("32/8x128, 16/1x64").unwrap();
        assert_eq!(
            s.iter()
                .map(|s| (s.q_heads, s.kv_heads, s.head_dim))
                .collect::<Vec<_>>(),
            [(32, 8, 128), (16, 1, 64)]
        );
        assert_eq!(parse_heads(DEFAULT_HEADS).unwrap().len(), 6);
        for bad in ["32/8", "32x128", "30/8x128", "a/bxc", ""] {
            assert!(parse_heads(bad).is_err(), "{bad}");
        }
    }
}
