//! The one description of a distributed attention run, whatever ran it: CPU ranks over host
//! collectives or GPUs over NCCL, threads or MPI processes. Benchmarks print it, save it as
//! JSON and read it back (`bench scaling --from`).

use crate::cost::PaperModel;
use crate::Strategy;
use canopy_core::stats::quantile;
use canopy_core::{AttnShape, AttnStates, KvTree};
use serde::{Deserialize, Serialize};

/// One measured (strategy, ranks, context) point.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunReport {
    /// `tree/<collective>` or `ring`; `tree/auto (<chosen>)` when the cost model chose.
    pub strategy: String,
    pub ranks: usize,
    /// The longest sequence's tokens (a `long` workload's context length).
    pub seq_len: u32,
    /// Decode queries per step (a `long` workload's sequences).
    pub batch: u32,
    pub median_ms: f64,
    pub p10_ms: f64,
    pub p90_ms: f64,
    /// The largest shard's K and V bytes.
    pub kv_bytes_per_rank: u64,
    /// Bytes the busiest rank sent per step, counted at each call (ring-algorithm volumes for
    /// collectives, the buffer for a send).
    pub comm_bytes_per_rank: u64,
    /// The paper's analytic bytes per rank and step.
    pub paper_comm_bytes: u64,
    /// Device memory the busiest rank used (GPUs; none measured on the CPU).
    pub peak_mem_bytes: Option<u64>,
    /// The paper's analytic per-rank memory.
    pub paper_mem_bytes: u64,
    /// Ring on GPUs: the send/recv bandwidth measured alone (GB/s sent per rank).
    pub link_gbps: Option<f64>,
    /// Largest relative error of any checked output against the f64 oracle.
    pub rel_error: Option<f64>,
    /// Largest relative difference between any rank's output and rank 0's, where every
    /// rank's output was compared.
    #[serde(default)]
    pub rank_spread: Option<f64>,
    /// Rank 0's output of the last step, for checks.
    #[serde(skip)]
    pub output: Option<AttnStates>,
}

/// What a run measured, before it is described.
pub struct Measured {
    pub strategy: Strategy,
    /// The merge `auto` chose, if it chose.
    pub chosen: Option<crate::MergeCollective>,
    pub ranks: usize,
    /// Milliseconds of each timed step.
    pub times_ms: Vec<f64>,
    pub kv_bytes_per_rank: u64,
    pub comm_bytes_per_rank: u64,
    pub peak_mem_bytes: Option<u64>,
    pub link_gbps: Option<f64>,
    pub rel_error: Option<f64>,
    pub rank_spread: Option<f64>,
    pub output: Option<AttnStates>,
}

impl RunReport {
    /// The report of `m`, a run over `tree` with attention `shape`, with the paper's figures
    /// beside it.
    pub fn new(m: Measured, tree: &KvTree, shape: &AttnShape) -> RunReport {
        let queries = tree.num_queries() as u64;
        let paper = PaperModel::of(
            m.strategy,
            m.ranks as u64,
            queries * shape.q_heads as u64,
            shape.head_dim as u64,
            m.kv_bytes_per_rank,
        );
        RunReport {
            strategy: match m.chosen {
                Some(c) => format!("{} ({})", m.strategy.name(), c.name()),
                None => m.strategy.name(),
            },
            ranks: m.ranks,
            seq_len: tree
                .root_spans()
                .iter()
                .map(|s| s.end - s.start)
                .max()
                .unwrap_or(0),
            batch: queries as u32,
            median_ms: quantile(&m.times_ms, 0.5),
            p10_ms: quantile(&m.times_ms, 0.1),
            p90_ms: quantile(&m.times_ms, 0.9),
            kv_bytes_per_rank: m.kv_bytes_per_rank,
            comm_bytes_per_rank: m.comm_bytes_per_rank,
            paper_comm_bytes: paper.comm_bytes,
            peak_mem_bytes: m.peak_mem_bytes,
            paper_mem_bytes: paper.memory_bytes,
            link_gbps: m.link_gbps,
            rel_error: m.rel_error,
            rank_spread: m.rank_spread,
            output: m.output,
        }
    }
}
