//! `canopy bench scaling`: tree vs ring over a sweep of rank counts and context lengths.
//!
//! Every (strategy, collective, p, N) point is one run of `canopy bench attention`'s code; the
//! table adds the tree/ring ratio at each (p, N), the bytes each rank sent beside the paper's
//! formula, and the peak device memory per rank beside the paper's. `--csv` and `--json` write
//! every field; `--plot` draws latency and ring/tree ratio against N and against p (PNG or SVG
//! by the file's extension). `--from` re-draws a saved `--json` without running anything, for
//! plots made away from the GPU machine.

use crate::bench::{resolve_backend, row_table, rows, Row, RunArgs, World};
use anyhow::{bail, Context, Result};
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
    #[arg(long, value_delimiter = ',')]
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
    pub rows: Vec<Row>,
}

pub fn run(a: ScalingArgs) -> Result<()> {
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
        "cuda" => vec![131072, 524288, 1048576, 4194304],
        _ => vec![4096, 16384, 65536],
    });
    let mut all = Vec::new();
    for &n in &seq_lens {
        for &p in &ranks {
            let mut run = a.run.clone();
            if let Some(k) = run.virtual_nodes.filter(|&k| p % k != 0) {
                eprintln!(
                    "note: {p} ranks do not split into {k} virtual nodes; p={p} runs as one node"
                );
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
        backend: backend.into(),
        q_heads: spec.shape.q_heads,
        kv_heads: spec.shape.kv_heads,
        head_dim: spec.shape.head_dim,
        dtype: spec.dtype.to_string(),
        iters: a.run.iters,
        rows: all,
    }))
}

/// The ring's median at the same (p, N) over this row's: how many times faster the tree is.
pub fn ring_over_tree(rows: &[Row], r: &Row) -> Option<f64> {
    rows.iter()
        .find(|x| x.strategy == "ring" && x.ranks == r.ranks && x.seq_len == r.seq_len)
        .map(|ring| ring.median_ms / r.median_ms)
}

fn ratio_table(rows: &[Row]) -> crate::table::Table {
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
