//! `bench decode --from RUN.json… --predict P`: a model's decode step at a rank count that was
//! not measured (an 8-GPU node from a 4-GPU machine's runs), from saved `--json` runs, with
//! [`canopy_engine::predict::DecodeModel`] fitted to their rows at fewer ranks. Rows measured
//! at P are set beside the prediction, so predicting a measured count checks the model on rows
//! it did not see.
//!
//! A saved row does not carry its KV bytes; its floor does: (weights + the rank's KV) / copy
//! bandwidth, with both in the run. So every row the fit reads needs a floor (a GPU run). Rows
//! whose ranks shared a GPU are left out: their ranks took turns on one device, which more
//! GPUs would not.

use super::report::opt;
use crate::scaling::{error_cell, strategy_of};
use crate::table::Table;
use anyhow::{bail, Context, Result};
use canopy_engine::predict::{DecodeModel, DecodeSample};
use canopy_engine::Strategy;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

/// The fields of a saved `bench decode --json` run that a prediction reads.
#[derive(Deserialize)]
struct SavedRun {
    model: String,
    weight_bytes: u64,
    copy_bandwidth_gb_s: Option<f64>,
    rows: Vec<SavedRow>,
}

#[derive(Deserialize)]
struct SavedRow {
    context: usize,
    ranks: usize,
    strategy: String,
    decode_ms_per_token: Option<f64>,
    floor_ms: Option<f64>,
    /// Absent from runs saved before rows carried it, whose floors priced one rank: read as 1.
    #[serde(default = "one_rank_per_device")]
    ranks_per_device: usize,
}

fn one_rank_per_device() -> usize {
    1
}

/// A saved row as the fit and the floors read it.
struct Step {
    strategy: Strategy,
    context: usize,
    ranks: usize,
    /// The KV bytes one rank reads for a token.
    kv_per_rank: f64,
    ms: f64,
    /// The run's weights and copy bandwidth (bytes per second), for floors at other ranks.
    weight_bytes: f64,
    copy_bytes_per_s: f64,
}

/// What `--predict --json` prints.
#[derive(Serialize)]
struct PredictionOutput {
    model: String,
    ranks: usize,
    fits: Vec<DecodeModel>,
    rows: Vec<Predicted>,
}

#[derive(Serialize)]
struct Predicted {
    strategy: String,
    context: usize,
    predicted_ms: f64,
    /// (weights + a rank's KV) / copy bandwidth, at the run's bandwidth.
    floor_ms: f64,
    measured_ms: Option<f64>,
    /// (predicted - measured) / measured.
    error: Option<f64>,
}

fn read(files: &[PathBuf]) -> Result<(String, Vec<Step>)> {
    let mut model = None;
    let mut steps = Vec::new();
    for path in files {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let run: SavedRun = serde_json::from_str(&text)
            .with_context(|| format!("{} is not a `bench decode --json` output", path.display()))?;
        match &model {
            None => model = Some(run.model.clone()),
            Some(m) if *m != run.model => {
                bail!(
                    "{} measures {}, not {m}: predict from one model's runs",
                    path.display(),
                    run.model
                )
            }
            Some(_) => {}
        }
        let Some(gb_s) = run.copy_bandwidth_gb_s else {
            bail!(
                "{} has no copy bandwidth (a CPU run): predict from GPU runs, whose floors give each row's KV bytes",
                path.display()
            );
        };
        let copy_bytes_per_s = gb_s * 1e9;
        for row in run.rows.iter().filter(|r| r.ranks_per_device == 1) {
            let (Some(strategy), Some(ms), Some(floor)) = (
                strategy_of(&row.strategy),
                row.decode_ms_per_token,
                row.floor_ms,
            ) else {
                continue;
            };
            steps.push(Step {
                strategy,
                context: row.context,
                ranks: row.ranks,
                kv_per_rank: (floor / 1e3 * copy_bytes_per_s - run.weight_bytes as f64).max(0.0),
                ms,
                weight_bytes: run.weight_bytes as f64,
                copy_bytes_per_s,
            });
        }
    }
    match model {
        Some(m) if !steps.is_empty() => Ok((m, steps)),
        _ => bail!("the runs have no decode rows to fit"),
    }
}

/// Predicts every strategy the runs measured on several ranks at `p` ranks, at every context
/// the runs measured and at `extra` contexts (tokens: 2M, 4M…).
pub fn run(files: &[PathBuf], p: usize, extra: &[usize], json: bool) -> Result<()> {
    if p < 3 {
        bail!("--predict needs 3 ranks or more: what several ranks add is fitted to the runs at 2 to P - 1 ranks");
    }
    let (model, steps) = read(files)?;
    let sample = |s: &Step| DecodeSample {
        ranks: s.ranks,
        kv_bytes_per_rank: s.kv_per_rank,
        ms: s.ms,
    };
    let one_rank: Vec<DecodeSample> = steps.iter().filter(|s| s.ranks == 1).map(sample).collect();
    let strategies: BTreeSet<Strategy> = steps
        .iter()
        .filter(|s| s.ranks > 1 && s.ranks < p)
        .map(|s| s.strategy)
        .collect();
    if strategies.is_empty() {
        bail!(
            "the runs have no rows on 2 to {} ranks, to which what several ranks add is fitted",
            p - 1
        );
    }
    let fits = strategies
        .iter()
        .map(|&strategy| {
            let several: Vec<DecodeSample> = steps
                .iter()
                .filter(|s| s.strategy == strategy && s.ranks > 1 && s.ranks < p)
                .map(sample)
                .collect();
            Ok(DecodeModel::fit(strategy, &one_rank, &several)?)
        })
        .collect::<Result<Vec<_>>>()?;
    // Each context's whole KV and its run's device, from any row at it; the extra contexts
    // scale the KV of a token from the longest measured one.
    let mut contexts: BTreeMap<usize, (f64, &Step)> = BTreeMap::new();
    for s in &steps {
        contexts
            .entry(s.context)
            .or_insert((s.kv_per_rank * s.ranks as f64, s));
    }
    if let Some((&longest, &(kv, s))) = contexts.iter().next_back() {
        for &n in extra {
            contexts
                .entry(n)
                .or_insert((kv * n as f64 / longest as f64, s));
        }
    }
    let mut rows = Vec::new();
    for fit in &fits {
        for (&context, &(kv, device)) in &contexts {
            let kv_per_rank = kv / p as f64;
            let predicted_ms = fit.predict(p, kv_per_rank);
            let measured_ms = steps
                .iter()
                .find(|s| s.strategy == fit.strategy && s.ranks == p && s.context == context)
                .map(|s| s.ms);
            rows.push(Predicted {
                strategy: fit.strategy.name(),
                context,
                predicted_ms,
                floor_ms: (device.weight_bytes + kv_per_rank) / device.copy_bytes_per_s * 1e3,
                measured_ms,
                error: measured_ms.map(|m| (predicted_ms - m) / m),
            });
        }
    }
    let out = PredictionOutput {
        model,
        ranks: p,
        fits,
        rows,
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        print(&out, steps.iter().filter(|s| s.ranks < p).count());
    }
    Ok(())
}

/// The fits and the table, for the terminal.
fn print(out: &PredictionOutput, fitted_rows: usize) {
    println!(
        "{}: decode at {} ranks, predicted from {fitted_rows} rows at fewer ranks",
        out.model, out.ranks
    );
    for f in &out.fits {
        let across = match f.strategy {
            Strategy::Ring => format!(
                "hand-offs {:.3} ms + {:.3} ms per GB of a shard, per peer",
                f.across.intercept,
                f.across.slope * 1e9
            ),
            Strategy::Tree(_) => format!(
                "merges {:.3} ms + {:.3} ms per peer",
                f.across.intercept, f.across.slope
            ),
        };
        println!(
            "  {}: one rank {:.3} ms + {:.3} ms per GB of KV it reads; {across}",
            f.strategy.name(),
            f.local.intercept,
            f.local.slope * 1e9
        );
    }
    let mut t = Table::new(&[
        "strategy",
        "context",
        "predicted ms",
        "floor ms",
        "x floor",
        "measured ms",
        "error",
    ]);
    for r in &out.rows {
        t.row(vec![
            r.strategy.clone(),
            r.context.to_string(),
            format!("{:.2}", r.predicted_ms),
            format!("{:.2}", r.floor_ms),
            format!("{:.2}", r.predicted_ms / r.floor_ms),
            opt(r.measured_ms, 2),
            error_cell(r.error),
        ]);
    }
    println!("{}", t.render());
}
