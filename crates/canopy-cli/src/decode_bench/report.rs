//! What `bench decode` reports: one row per (context, ranks, strategy), the run's own
//! measurements of the device beside them, and the paper's Table 1 (tree against ring at each
//! context and rank count) as a table, JSON or CSV.

use crate::table::{bytes, Table};
use anyhow::{Context, Result};
use serde::Serialize;
use std::path::Path;

/// One measured configuration.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub context: usize,
    pub ranks: usize,
    pub strategy: String,
    pub context_fill: &'static str,
    /// Seconds to fill the context (the prefill, or the random fill).
    pub fill_s: f64,
    /// The prompt's tokens over the prefill's seconds (none with a random fill).
    pub prefill_tokens_per_s: Option<f64>,
    /// The prefill's FLOPs (`cost::prefill_flops`) over its seconds, per device it ran on.
    pub prefill_tflops_per_device: Option<f64>,
    /// Seconds from the request to the first token.
    pub ttft_s: f64,
    /// The median decode step (the steps whose merges were not timed).
    pub decode_ms_per_token: Option<f64>,
    /// The mean of the same steps. It counts the steps that plan afresh (a leaf past its
    /// growth room) and record a new graph, which the median leaves out.
    pub decode_mean_ms_per_token: Option<f64>,
    pub decode_tokens_per_s: Option<f64>,
    /// Decode steps replayed from a recorded graph (a step that records or runs op by op
    /// costs more: the first, and those after a replan that could not keep the recording).
    pub replayed_steps: usize,
    /// The paper's time: from the request to the last decoded token.
    pub total_s: f64,
    /// Ranks on the busiest device: more than one where ranks share a GPU.
    pub ranks_per_device: usize,
    /// The step's floor on the busiest device: (weights + a rank's KV) for each rank on it,
    /// over the copy bandwidth.
    pub floor_ms: Option<f64>,
    pub vs_floor: Option<f64>,
    /// The tree's cross-rank merge per layer: the median over the timed steps of their
    /// merges' time, over the layers (none for the ring, or one rank).
    pub merge_ms_per_layer: Option<f64>,
    /// The busiest rank's peak memory, measured as [`RunInfo::peak_memory`] says.
    pub peak_bytes: Option<u64>,
}

/// The run as a whole: the model and the device, with the rates measured in the same run.
#[derive(Debug, Clone, Serialize)]
pub struct RunInfo {
    pub model: String,
    pub backend: String,
    pub dtype: String,
    pub weight_bytes: u64,
    /// GPUs (or the host) the ranks run on; ranks beyond them share them.
    pub devices: usize,
    pub copy_bandwidth_gb_s: Option<f64>,
    /// `LayerOps::matmul` at the shape `gemm_shape` (rows × cols × inner) names.
    pub gemm_tflops: f64,
    pub gemm_shape: String,
    /// How `peak_bytes` was measured.
    pub peak_memory: &'static str,
}

/// The longest context one device holds at a rank count, as its backend prices a run.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Capacity {
    pub ranks: usize,
    pub context_fill: &'static str,
    /// `None`: not even one token fits beside the weights.
    pub longest_context: Option<usize>,
    /// What ends it: `memory`; `positions` (the model's, less the decoded tokens: a prefill
    /// goes no further whatever the memory); or `the search's limit` (2²⁸ tokens).
    pub bound_by: &'static str,
}

/// Tree against ring at one (context, ranks): a row of the paper's Table 1.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Pair {
    pub context: usize,
    pub ranks: usize,
    pub tree: String,
    pub tree_s: f64,
    pub ring_s: f64,
    /// `ring_s / tree_s`.
    pub speedup: f64,
    pub tree_ms_per_token: Option<f64>,
    pub ring_ms_per_token: Option<f64>,
    /// Ring over tree, per decoded token.
    pub decode_speedup: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    #[serde(flatten)]
    pub run: RunInfo,
    pub capacity: Vec<Capacity>,
    /// Whether a context runs past the model's positions (a random fill only).
    pub past_model_positions: bool,
    pub rows: Vec<Row>,
    pub table1: Vec<Pair>,
}

impl Report {
    pub fn new(
        run: RunInfo,
        capacity: Vec<Capacity>,
        past_model_positions: bool,
        rows: Vec<Row>,
    ) -> Report {
        let table1 = pairs(&rows);
        Report {
            run,
            capacity,
            past_model_positions,
            rows,
            table1,
        }
    }

    /// One CSV line per row, the run's fields first: every field of the JSON but Table 1 and
    /// the capacity.
    pub fn write_csv(&self, path: &Path) -> Result<()> {
        let mut w =
            csv::Writer::from_path(path).with_context(|| format!("creating {}", path.display()))?;
        for row in &self.rows {
            w.serialize((&self.run, row))?;
        }
        w.flush()
            .with_context(|| format!("writing {}", path.display()))?;
        Ok(())
    }

    pub fn print(&self) {
        println!("{}", self.rows_table().render());
        let r = &self.run;
        println!(
            "{} on {} ({}), weights {}; {}GEMM {} TFLOP/s at {}",
            r.model,
            r.backend,
            r.dtype,
            bytes(r.weight_bytes),
            r.copy_bandwidth_gb_s
                .map_or(String::new(), |b| format!("copy bandwidth {b:.0} GB/s; ")),
            significant(r.gemm_tflops),
            r.gemm_shape,
        );
        println!("peak memory: {}", r.peak_memory);
        for c in &self.capacity {
            println!(
                "the longest context one device holds at {} rank(s), {}: {} (bound by {})",
                c.ranks,
                c.context_fill,
                c.longest_context
                    .map_or("none".into(), |n| format!("{n} tokens")),
                c.bound_by
            );
        }
        if self.rows.iter().any(|r| r.merge_ms_per_layer.is_some()) {
            println!("merge ms/layer: the tree's cross-rank merge, timed with the device synchronised on every second decode step (steps left out of ms/token)");
        }
        let gpu = r.copy_bandwidth_gb_s.is_some();
        if gpu && self.rows.iter().any(|row| row.ranks_per_device > 1) {
            println!("ranks that share a GPU each read every weight and their KV through it: their floor counts every rank on the busiest GPU, and their times measure that sharing, not what more GPUs would do");
        }
        if self.rows.iter().any(|row| row.context_fill == "random") {
            println!(
                "the context's KV was filled at random, not prefilled: the tokens mean nothing"
            );
        }
        if self.past_model_positions {
            println!("contexts run past the model's positions: a timing only");
        }
        if !self.table1.is_empty() {
            println!("\nTable 1: time from request to the last token, tree against ring");
            println!("{}", self.table1_table().render());
        }
    }

    fn rows_table(&self) -> Table {
        let mut t = Table::new(&[
            "context",
            "ranks",
            "strategy",
            "fill",
            "fill s",
            "prefill tok/s",
            "TFLOP/s",
            "TTFT s",
            "ms/token",
            "mean ms",
            "tokens/s",
            "floor ms",
            "x floor",
            "merge ms/layer",
            "peak",
        ]);
        for row in &self.rows {
            t.row(vec![
                row.context.to_string(),
                row.ranks.to_string(),
                row.strategy.clone(),
                row.context_fill.to_string(),
                format!("{:.2}", row.fill_s),
                opt(row.prefill_tokens_per_s, 0),
                row.prefill_tflops_per_device
                    .map_or("-".into(), significant),
                format!("{:.2}", row.ttft_s),
                opt(row.decode_ms_per_token, 2),
                opt(row.decode_mean_ms_per_token, 2),
                opt(row.decode_tokens_per_s, 1),
                opt(row.floor_ms, 2),
                opt(row.vs_floor, 2),
                opt(row.merge_ms_per_layer, 3),
                row.peak_bytes.map_or("-".into(), bytes),
            ]);
        }
        t
    }

    fn table1_table(&self) -> Table {
        let mut t = Table::new(&[
            "context",
            "ranks",
            "tree",
            "tree s",
            "ring s",
            "speedup",
            "tree ms/token",
            "ring ms/token",
            "decode speedup",
        ]);
        for p in &self.table1 {
            t.row(vec![
                p.context.to_string(),
                p.ranks.to_string(),
                p.tree.clone(),
                format!("{:.3}", p.tree_s),
                format!("{:.3}", p.ring_s),
                format!("{:.2}x", p.speedup),
                opt(p.tree_ms_per_token, 2),
                opt(p.ring_ms_per_token, 2),
                p.decode_speedup.map_or("-".into(), |x| format!("{x:.2}x")),
            ]);
        }
        t
    }
}

/// An optional number as a table cell: `-` without one.
pub(super) fn opt(x: Option<f64>, decimals: usize) -> String {
    x.map_or("-".into(), |x| format!("{x:.decimals$}"))
}

/// `x` to three significant digits (a CPU's TFLOP/s are thousandths, a GPU's hundreds), or
/// to whole units from 1000 up.
fn significant(x: f64) -> String {
    let decimals = match x.abs() {
        x if x >= 100.0 || x == 0.0 => 0,
        x => (2.0 - x.log10().floor()) as usize,
    };
    format!("{x:.decimals$}")
}

/// Table 1: at each (context, ranks) that ran both, the tree's row (the first, if several)
/// against the ring's, in the rows' order.
pub fn pairs(rows: &[Row]) -> Vec<Pair> {
    let mut out: Vec<Pair> = Vec::new();
    for tree in rows.iter().filter(|r| r.strategy.starts_with("tree")) {
        if out
            .iter()
            .any(|p| (p.context, p.ranks) == (tree.context, tree.ranks))
        {
            continue;
        }
        let Some(ring) = rows
            .iter()
            .find(|r| r.strategy == "ring" && (r.context, r.ranks) == (tree.context, tree.ranks))
        else {
            continue;
        };
        out.push(Pair {
            context: tree.context,
            ranks: tree.ranks,
            tree: tree.strategy.clone(),
            tree_s: tree.total_s,
            ring_s: ring.total_s,
            speedup: ring.total_s / tree.total_s,
            tree_ms_per_token: tree.decode_ms_per_token,
            ring_ms_per_token: ring.decode_ms_per_token,
            decode_speedup: ring
                .decode_ms_per_token
                .zip(tree.decode_ms_per_token)
                .map(|(r, t)| r / t),
        });
    }
    out
}

/// Rows and reports for the tests of the report and of its plot.
#[cfg(test)]
pub(crate) mod fixtures {
    use super::*;

    /// A row at `context` and `ranks` of `strategy`, `total_s` to its last token, `ms` a step
    /// and a floor of half a millisecond a rank.
    pub fn row(context: usize, ranks: usize, strategy: &str, total_s: f64, ms: f64) -> Row {
        Row {
            context,
            ranks,
            strategy: strategy.into(),
            context_fill: "prefill",
            fill_s: total_s / 2.0,
            prefill_tokens_per_s: Some(1000.0),
            prefill_tflops_per_device: None,
            ttft_s: total_s / 2.0,
            decode_ms_per_token: Some(ms),
            decode_mean_ms_per_token: Some(ms),
            decode_tokens_per_s: Some(1e3 / ms),
            replayed_steps: 0,
            total_s,
            ranks_per_device: 1,
            floor_ms: (context > 0).then_some(0.5 * ranks as f64),
            vs_floor: None,
            merge_ms_per_layer: None,
            peak_bytes: Some(1 << 20),
        }
    }

    pub fn report(rows: Vec<Row>) -> Report {
        let run = RunInfo {
            model: "m".into(),
            backend: "cpu".into(),
            dtype: "f32".into(),
            weight_bytes: 1,
            devices: 1,
            copy_bandwidth_gb_s: None,
            gemm_tflops: 0.5,
            gemm_shape: "1 × 2 × 3".into(),
            peak_memory: "test",
        };
        Report::new(run, Vec::new(), false, rows)
    }
}

#[cfg(test)]
mod tests {
    use super::fixtures::{report, row};
    use super::*;

    #[test]
    fn table_1_pairs_tree_and_ring_at_each_context_and_rank_count() {
        let rows = vec![
            row(64, 1, "tree/auto", 2.0, 10.0),
            row(64, 1, "ring", 3.0, 15.0),
            row(64, 2, "tree/auto", 1.0, 5.0),
            row(128, 1, "ring", 4.0, 1.0), // no tree here
            row(64, 2, "ring", 4.0, 20.0),
        ];
        let p = pairs(&rows);
        assert_eq!(p.len(), 2);
        assert_eq!((p[0].context, p[0].ranks, p[0].speedup), (64, 1, 1.5));
        assert_eq!(p[0].decode_speedup, Some(1.5));
        assert_eq!((p[1].context, p[1].ranks, p[1].speedup), (64, 2, 4.0));
        assert_eq!(p[1].ring_ms_per_token, Some(20.0));
        assert!(pairs(&rows[..1]).is_empty(), "a tree alone has no pair");
    }

    #[test]
    fn the_csv_has_a_header_and_one_line_per_row() {
        let r = report(vec![
            row(64, 1, "tree/auto", 2.0, 10.0),
            row(64, 1, "ring", 3.0, 15.0),
        ]);
        let path = std::env::temp_dir().join(format!("canopy-decode-{}.csv", std::process::id()));
        r.write_csv(&path).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::remove_file(&path).ok();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{text}");
        let header: Vec<&str> = lines[0].split(',').collect();
        assert_eq!(header[..3], ["model", "backend", "dtype"]);
        for field in ["context", "ttft_s", "total_s", "peak_bytes", "gemm_tflops"] {
            assert!(header.contains(&field), "{field} in {header:?}");
        }
        let ring: Vec<&str> = lines[2].split(',').collect();
        assert_eq!(ring.len(), header.len());
        let at = |name: &str| header.iter().position(|h| *h == name).unwrap();
        assert_eq!(ring[at("strategy")], "ring");
        assert_eq!(
            ring[at("vs_floor")],
            "",
            "a missing value is an empty field"
        );
    }

    #[test]
    fn rates_keep_three_significant_digits() {
        assert_eq!(significant(612.34), "612");
        assert_eq!(significant(61.234), "61.2");
        assert_eq!(significant(1.5), "1.50");
        assert_eq!(significant(0.000267), "0.000267");
        assert_eq!(significant(0.0), "0");
    }

    #[test]
    fn the_json_flattens_the_run_and_carries_table_1() {
        let r = report(vec![
            row(64, 1, "tree/auto", 2.0, 10.0),
            row(64, 1, "ring", 3.0, 15.0),
        ]);
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(v["backend"], "cpu");
        assert_eq!(v["table1"][0]["speedup"], 1.5);
        assert_eq!(v["rows"].as_array().unwrap().len(), 2);
    }
}
