//! `canopy bench scaling`: tree vs ring over a sweep of rank counts and context lengths.
//!
//! Every (strategy, collective, p, N) point is one run of `canopy bench attention`'s code; the
//! table adds the tree/ring ratio at each (p, N), the bytes each rank sent beside the paper's
//! formula, and the peak device memory per rank beside the paper's. `--csv` and `--json` write
//! every field; `--plot` draws latency and ring/tree ratio against N and against p (PNG or SVG
//! by the file's extension). `--from` re-draws a saved `--json` without running anything, for
//! plots made away from the GPU machine.

use crate::bench::{resolve_backend, row_table, rows, BackendKind, RunArgs, World};
use anyhow::{bail, Context, Result};
use canopy_engine::predict::{StepModel, StepSample};
use canopy_engine::RunReport;
use canopy_engine::{NodeLayout, Strategy};
use clap::Args;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

#[derive(Args)]
pub struct ScalingArgs {
    #[command(flatten)]
    run: RunArgs,
    /// Rank counts (under mpirun: the world size, which must be in the list).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    ranks: Vec<usize>,
    /// Context lengths; default 131072,524288,1048576,4194304 on CUDA and 4096,16384,65536 on
    /// the CPU.
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u32).range(1..))]
    seq_lens: Option<Vec<u32>>,
    /// Write every row as CSV.
    #[arg(long)]
    csv: Option<PathBuf>,
    /// Draw the scaling plot (PNG or SVG, by extension).
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Re-draw and re-tabulate a saved `--json` output instead of running.
    #[arg(long)]
    from: Option<PathBuf>,
    /// Predict every strategy at this rank count (hierarchical over `--virtual-nodes`) from
    /// the rows at fewer ranks, with the model of `canopy_engine::predict`, at the rows' context
    /// lengths and `--seq-lens`; rows measured at this count are set beside the prediction.
    #[arg(long)]
    predict: Option<usize>,
}

/// What `--json` prints and `--from` reads.
#[derive(Serialize, Deserialize)]
pub struct ScalingOutput {
    pub backend: String,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub dtype: String,
    pub iters: usize,
    pub rows: Vec<RunReport>,
}

pub fn run(a: ScalingArgs) -> Result<()> {
    // A plot that cannot be written is refused here, not after minutes of benchmarking.
    if let Some(path) = &a.plot {
        crate::plot::check(path)?;
    }
    let out = match &a.from {
        Some(path) => serde_json::from_str(
            &std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?,
        )
        .with_context(|| format!("{} is not a `bench scaling --json` output", path.display()))?,
        None => match measure(&a)? {
            Some(out) => out,
            None => return Ok(()), // MPI ranks other than 0
        },
    };
    if let Some(path) = &a.csv {
        let mut w =
            csv::Writer::from_path(path).with_context(|| format!("creating {}", path.display()))?;
        for r in &out.rows {
            w.serialize(r)?;
        }
        w.flush()?;
    }
    if let Some(path) = &a.plot {
        crate::plot::scaling(&out, path)?;
    }
    if let Some(p) = a.predict {
        return predict(&a, &out, p);
    }
    if a.run.json {
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!(
        "scaling on {}: {}/{} heads x {}, {}, {} iters",
        out.backend, out.q_heads, out.kv_heads, out.head_dim, out.dtype, out.iters
    );
    println!("{}", row_table(&out.rows).render());
    println!("{}", ratio_table(&out.rows).render());
    Ok(())
}

fn measure(a: &ScalingArgs) -> Result<Option<ScalingOutput>> {
    if a.ranks.contains(&0) {
        bail!("--ranks must all be at least 1");
    }
    let backend = resolve_backend(a.run.backend)?;
    let world = World::new(a.run.launcher)?;
    let ranks: Vec<usize> = match world.mpi_size() {
        Some(p) if a.ranks.contains(&p) => vec![p],
        Some(p) => bail!(
            "mpirun started {p} ranks but --ranks is {:?}; launch once per rank count",
            a.ranks
        ),
        None => a.ranks.clone(),
    };
    let seq_lens = a.seq_lens.clone().unwrap_or_else(|| match backend {
        BackendKind::Cuda => vec![131072, 524288, 1048576, 4194304],
        _ => vec![4096, 16384, 65536],
    });
    let mut all = Vec::new();
    for &n in &seq_lens {
        for &p in &ranks {
            let mut run = a.run.clone();
            if let Some(k) = run.virtual_nodes.filter(|&k| p % k != 0) {
                crate::launcher::note(format_args!(
                    "{p} ranks do not split into {k} virtual nodes; p={p} runs as one node"
                ));
                run.virtual_nodes = None;
            }
            match rows(&run, &world, backend, p, n)? {
                Some(r) => all.extend(r),
                None => continue,
            }
        }
    }
    if world.mpi_size().is_some() && all.is_empty() {
        return Ok(None);
    }
    let spec = crate::bench::long_spec(&a.run, seq_lens[0])?;
    Ok(Some(ScalingOutput {
        backend: backend.to_string(),
        q_heads: spec.shape.q_heads,
        kv_heads: spec.shape.kv_heads,
        head_dim: spec.shape.head_dim,
        dtype: spec.dtype.to_string(),
        iters: a.run.iters,
        rows: all,
    }))
}

/// What `--predict --json` prints.
#[derive(Serialize)]
struct PredictionOutput {
    ranks: usize,
    virtual_nodes: usize,
    model: StepModel,
    rows: Vec<Prediction>,
}

#[derive(Serialize)]
struct Prediction {
    strategy: String,
    seq_len: u32,
    batch: u32,
    predicted_ms: f64,
    measured_ms: Option<f64>,
    /// (predicted - measured) / measured.
    error: Option<f64>,
}

/// A prediction further than this from the measurement is flagged.
const MISS: f64 = 0.15;

/// A prediction's error against its measurement, as a table cell: `-` without one, flagged
/// past [`MISS`].
pub(crate) fn error_cell(error: Option<f64>) -> String {
    error.map_or("-".into(), |e| {
        let flag = if e.abs() > MISS { " (miss)" } else { "" };
        format!("{:+.1}%{flag}", e * 100.0)
    })
}

/// The strategy of a row: "tree/allgather", "ring", or "tree/auto (allgather)" for auto with
/// its choice.
pub(crate) fn strategy_of(row: &str) -> Option<Strategy> {
    let name = row.split(' ').next()?;
    Strategy::every().into_iter().find(|s| s.name() == name)
}

fn predict(a: &ScalingArgs, out: &ScalingOutput, p: usize) -> Result<()> {
    let samples: Vec<StepSample> = out
        .rows
        .iter()
        .filter(|r| r.ranks < p)
        .filter_map(|r| {
            Some(StepSample {
                strategy: strategy_of(&r.strategy)?,
                ranks: r.ranks,
                kv_bytes_per_rank: r.kv_bytes_per_rank,
                us: r.median_ms * 1e3,
            })
        })
        .collect();
    let model = StepModel::fit(&samples)?;
    let nodes = a
        .run
        .virtual_nodes
        .filter(|&k| p.is_multiple_of(k))
        .unwrap_or(1);
    let layout = NodeLayout::virtual_nodes(p, nodes)?;
    let Some(first) = out.rows.first() else {
        bail!("the scaling run has no rows to fit");
    };
    // KV bytes per token of one request, from any row.
    let per_token =
        first.kv_bytes_per_rank * first.ranks as u64 / (first.seq_len as u64 * first.batch as u64);
    let mut points: Vec<(u32, u32)> = out.rows.iter().map(|r| (r.seq_len, r.batch)).collect();
    for &n in a.seq_lens.iter().flatten() {
        points.push((n, first.batch));
    }
    points.sort_unstable();
    points.dedup();
    let mut rows = Vec::new();
    for strategy in Strategy::every() {
        for &(n, batch) in &points {
            let kv = (n as u64 * batch as u64 * per_token).div_ceil(p as u64);
            let cells = batch as u64 * out.q_heads as u64;
            let predicted_ms =
                model.predict(strategy, &layout, cells, out.head_dim as u64, kv) / 1e3;
            let measured_ms = out
                .rows
                .iter()
                .find(|r| {
                    r.ranks == p
                        && r.seq_len == n
                        && r.batch == batch
                        && strategy_of(&r.strategy) == Some(strategy)
                })
                .map(|r| r.median_ms);
            rows.push(Prediction {
                strategy: strategy.name(),
                seq_len: n,
                batch,
                predicted_ms,
                measured_ms,
                error: measured_ms.map(|m| (predicted_ms - m) / m),
            });
        }
    }
    if a.run.json {
        let o = PredictionOutput {
            ranks: p,
            virtual_nodes: nodes,
            model,
            rows,
        };
        println!("{}", serde_json::to_string_pretty(&o)?);
        return Ok(());
    }
    println!(
        "prediction for {p} ranks ({nodes} node(s)), fitted to {} rows at fewer ranks: {}/{} heads x {}, {}",
        samples.len(),
        out.q_heads,
        out.kv_heads,
        out.head_dim,
        out.dtype
    );
    println!(
        "model (µs): local {:.1} + {:.3} per MB of KV; merge fixed {:.1}; all-reduce {:.1} + {:.2} per peer; all-gather {:.1} + {:.2} per peer; ring hop {:.1} + {:.1} per MB",
        model.local.intercept,
        model.local.slope * 1e6,
        model.merge_fixed_us,
        model.all_reduce.intercept,
        model.all_reduce.slope,
        model.all_gather.intercept,
        model.all_gather.slope,
        model.ring_hop.intercept,
        model.ring_hop.slope * 1e6,
    );
    let mut t = crate::table::Table::new(&[
        "strategy",
        "N",
        "batch",
        "predicted ms",
        "measured ms",
        "error",
    ]);
    for r in &rows {
        t.row(vec![
            r.strategy.clone(),
            r.seq_len.to_string(),
            r.batch.to_string(),
            format!("{:.4}", r.predicted_ms),
            r.measured_ms.map_or("-".into(), |m| format!("{m:.4}")),
            error_cell(r.error),
        ]);
    }
    println!("{}", t.render());
    Ok(())
}

/// The ring's median at the same (p, N) over this row's: how many times faster the tree is.
pub fn ring_over_tree(rows: &[RunReport], r: &RunReport) -> Option<f64> {
    rows.iter()
        .find(|x| x.strategy == "ring" && x.ranks == r.ranks && x.seq_len == r.seq_len)
        .map(|ring| ring.median_ms / r.median_ms)
}

fn ratio_table(rows: &[RunReport]) -> crate::table::Table {
    let mut t =
        crate::table::Table::new(&["tree strategy", "ranks", "N", "median ms", "ring / tree"]);
    for r in rows.iter().filter(|r| r.strategy != "ring") {
        t.row(vec![
            r.strategy.clone(),
            r.ranks.to_string(),
            r.seq_len.to_string(),
            format!("{:.3}", r.median_ms),
            ring_over_tree(rows, r).map_or("-".into(), |x| format!("{x:.1}x")),
        ]);
    }
    t
}
