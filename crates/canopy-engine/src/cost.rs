//! The cost model of the cross-rank merge, behind the `auto` collective and the scaling
//! predictions.
//!
//! Each collective call costs `latency + wire_bytes / bandwidth` (an alpha-beta model), where
//! `wire_bytes` is what one rank sends under NCCL's ring algorithms: all-reduce
//! `2 (g-1)/g · n`, all-gather `(g-1) · n` (n per rank), reduce and broadcast `(g-1)/g · n`,
//! for a group of `g` ranks. At decode sizes the latency term dominates, which is why the merge
//! forms differ mainly in how many calls they issue.
//!
//! The model is calibrated where it runs: all-reduce and all-gather are timed at the merge's
//! two payload sizes (the lse column and the packed numerator|denominator), and a straight
//! line through the two points gives latency and bandwidth. Reduce and broadcast reuse the
//! all-reduce line. One level of links is assumed: on one host every group talks over the same
//! NVLink; across hosts, calibrate among node leaders as well.

use crate::merge::MergeCollective;
use crate::topology::NodeLayout;
use serde::Serialize;

/// The NCCL calls a merge issues.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum CallKind {
    AllReduce,
    /// Its payload is the whole buffer each rank holds, `group` blocks.
    ReduceScatter,
    AllGather,
    Reduce,
    Broadcast,
}

/// One collective call: its kind, the size of the group it runs on and the bytes each rank
/// contributes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Call {
    pub kind: CallKind,
    pub group: usize,
    pub payload_bytes: u64,
}

impl Call {
    /// Bytes one rank sends for this call under NCCL's ring algorithms.
    pub fn wire_bytes(&self) -> u64 {
        let (g, n) = (self.group as u64, self.payload_bytes);
        if g <= 1 {
            return 0;
        }
        match self.kind {
            CallKind::AllReduce => 2 * (g - 1) * n / g,
            CallKind::AllGather => (g - 1) * n,
            CallKind::ReduceScatter | CallKind::Reduce | CallKind::Broadcast => (g - 1) * n / g,
        }
    }
}

/// The calls of one merge of `cells` states of dimension `d` (f32), as issued by the rank that
/// issues the most (a node leader, for the hierarchical form). Calls on one-rank groups are
/// left out: they move nothing.
pub fn merge_calls(how: MergeCollective, layout: &NodeLayout, cells: u64, d: u64) -> Vec<Call> {
    let p = layout.ranks();
    let lse = cells * 4;
    let packed = cells * (d + 1) * 4;
    let call = |kind, group, payload_bytes| Call {
        kind,
        group,
        payload_bytes,
    };
    let calls = match how {
        MergeCollective::Allreduce3 => vec![
            call(CallKind::AllReduce, p, lse),
            call(CallKind::AllReduce, p, cells * d * 4),
            call(CallKind::AllReduce, p, lse),
        ],
        MergeCollective::Allreduce2 => vec![
            call(CallKind::AllReduce, p, lse),
            call(CallKind::AllReduce, p, packed),
        ],
        MergeCollective::Allgather => vec![call(CallKind::AllGather, p, packed)],
        MergeCollective::Hierarchical => {
            let (node, leaders) = (layout.max_node_size(), layout.nodes());
            vec![
                call(CallKind::AllReduce, node, lse),
                call(CallKind::Reduce, node, packed),
                call(CallKind::AllReduce, leaders, lse),
                call(CallKind::AllReduce, leaders, packed),
                call(CallKind::Broadcast, node, packed),
            ]
        }
        // Auto is resolved to one of the above before anything is sent.
        MergeCollective::Auto => Vec::new(),
    };
    calls.into_iter().filter(|c| c.group > 1).collect()
}

/// Bytes one rank sends per merge (the busiest rank's, for the hierarchical form).
pub fn merge_wire_bytes(how: MergeCollective, layout: &NodeLayout, cells: u64, d: u64) -> u64 {
    merge_calls(how, layout, cells, d)
        .iter()
        .map(Call::wire_bytes)
        .sum()
}

/// A line `latency + bytes / bandwidth` fitted to two timings.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct CallCost {
    pub latency_us: f64,
    /// Bytes per microsecond are thousands of GB/s: this is GB/s of wire bytes.
    pub gbps: f64,
}

impl CallCost {
    /// Fits the line through `(wire_bytes, microseconds)` samples `a` and `b`. When the larger
    /// message was not slower (noise at tiny sizes), the cost is all latency.
    pub fn fit(a: (f64, f64), b: (f64, f64)) -> CallCost {
        let ((b0, t0), (b1, t1)) = if a.0 <= b.0 { (a, b) } else { (b, a) };
        if b1 <= b0 || t1 <= t0 {
            return CallCost {
                latency_us: t0.min(t1),
                gbps: f64::INFINITY,
            };
        }
        let us_per_byte = (t1 - t0) / (b1 - b0);
        CallCost {
            latency_us: (t0 - b0 * us_per_byte).max(0.0),
            gbps: 1e-3 / us_per_byte,
        }
    }

    pub fn time_us(&self, wire_bytes: u64) -> f64 {
        self.latency_us + wire_bytes as f64 / (self.gbps * 1e3)
    }
}

/// Calibrated costs of the calls a merge issues.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct CostModel {
    pub all_reduce: CallCost,
    pub all_gather: CallCost,
}

impl CostModel {
    /// Calibrates with `time_us(kind, payload_bytes)`, which must time one call of `kind` on
    /// the whole world (every rank calls it identically, so every rank gets the same model
    /// only if `time_us` itself agrees across ranks, e.g. by taking the maximum over ranks).
    pub fn calibrate<E>(
        ranks: usize,
        cells: u64,
        d: u64,
        mut time_us: impl FnMut(CallKind, u64) -> Result<f64, E>,
    ) -> Result<CostModel, E> {
        let sizes = [cells * 4, cells * (d + 1) * 4];
        let mut fit = |kind| -> Result<CallCost, E> {
            let wire = |n| {
                Call {
                    kind,
                    group: ranks,
                    payload_bytes: n,
                }
                .wire_bytes() as f64
            };
            let a = (wire(sizes[0]), time_us(kind, sizes[0])?);
            let b = (wire(sizes[1]), time_us(kind, sizes[1])?);
            Ok(CallCost::fit(a, b))
        };
        Ok(CostModel {
            all_reduce: fit(CallKind::AllReduce)?,
            all_gather: fit(CallKind::AllGather)?,
        })
    }

    fn call_us(&self, c: &Call) -> f64 {
        match c.kind {
            CallKind::AllGather => self.all_gather.time_us(c.wire_bytes()),
            _ => self.all_reduce.time_us(c.wire_bytes()),
        }
    }

    /// Predicted microseconds of one merge.
    pub fn merge_us(&self, how: MergeCollective, layout: &NodeLayout, cells: u64, d: u64) -> f64 {
        merge_calls(how, layout, cells, d)
            .iter()
            .map(|c| self.call_us(c))
            .sum()
    }

    /// The cheapest concrete merge for `layout` (hierarchical only when there are several
    /// nodes); ties go to the earlier form in [`MergeCollective::CONCRETE`].
    pub fn choose(&self, layout: &NodeLayout, cells: u64, d: u64) -> MergeCollective {
        MergeCollective::CONCRETE
            .into_iter()
            .filter(|&c| c != MergeCollective::Hierarchical || layout.nodes() > 1)
            .map(|c| (c, self.merge_us(c, layout, cells, d)))
            .fold(
                None,
                |best: Option<(MergeCollective, f64)>, (c, t)| match best {
                    Some((_, bt)) if bt <= t => best,
                    _ => Some((c, t)),
                },
            )
            .map_or(MergeCollective::Allreduce2, |(c, _)| c)
    }
}

/// The Tree Attention paper's analytic per-rank figures, printed beside what canopy measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PaperModel {
    /// Bytes one rank sends per decode step.
    pub comm_bytes: u64,
    /// Device bytes one rank holds for attention (KV and what travels).
    pub memory_bytes: u64,
}

impl PaperModel {
    /// The model of `strategy` on `p` ranks merging `cells` states of dimension `d`.
    pub fn of(strategy: crate::Strategy, p: u64, cells: u64, d: u64, shard_kv_bytes: u64) -> Self {
        match strategy {
            crate::Strategy::Tree(_) => PaperModel::tree(p, cells, d, shard_kv_bytes),
            crate::Strategy::Ring => PaperModel::ring(p, shard_kv_bytes),
        }
    }

    /// Tree decoding (the paper's Algorithm 3): three ring all-reduces of the max, the numerator
    /// and the denominator, `cells × (d + 2)` fp32 values at `2 (p-1)/p` each; memory is the KV
    /// shard. `shard_kv_bytes` is the largest shard's K and V.
    pub fn tree(p: u64, cells: u64, d: u64, shard_kv_bytes: u64) -> PaperModel {
        PaperModel {
            comm_bytes: 2 * (p - 1) * cells * (d + 2) * 4 / p.max(1),
            memory_bytes: shard_kv_bytes,
        }
    }

    /// Ring attention: every rank passes `p - 1` K and V shards along; it holds its own shard
    /// and the one arriving (canopy double-buffers, so it holds one more to overlap).
    pub fn ring(p: u64, shard_kv_bytes: u64) -> PaperModel {
        PaperModel {
            comm_bytes: (p - 1) * shard_kv_bytes,
            memory_bytes: if p > 1 {
                2 * shard_kv_bytes
            } else {
                shard_kv_bytes
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fit_recovers_a_line() {
        let c = CallCost::fit((1000.0, 11.0), (1_001_000.0, 21.0));
        assert!((c.latency_us - 10.99).abs() < 1e-9);
        assert!((c.gbps - 100.0).abs() < 1e-9);
        assert!((c.time_us(2_000_000) - (10.99 + 20.0)).abs() < 1e-9);
        // A larger message that was faster is noise: all latency.
        let flat = CallCost::fit((1000.0, 11.0), (2000.0, 10.0));
        assert_eq!(flat.latency_us, 10.0);
        assert_eq!(flat.time_us(1 << 30), 10.0);
    }

    #[test]
    fn wire_bytes_follow_ring_formulas() {
        let l = NodeLayout::single(4);
        // allreduce2 of 8 cells x 128: max (32 B) then packed (8 x 129 x 4 B), each 2 (p-1)/p.
        assert_eq!(
            merge_wire_bytes(MergeCollective::Allreduce2, &l, 8, 128),
            (2 * 3 * 32 + 2 * 3 * 8 * 129 * 4) / 4
        );
        assert_eq!(
            merge_wire_bytes(MergeCollective::Allgather, &l, 8, 128),
            3 * 8 * 129 * 4
        );
        assert_eq!(
            merge_wire_bytes(MergeCollective::Allreduce2, &NodeLayout::single(1), 8, 128),
            0
        );
    }

    #[test]
    fn hierarchical_on_one_node_has_no_leader_stage() {
        let one = merge_calls(MergeCollective::Hierarchical, &NodeLayout::single(4), 4, 8);
        assert_eq!(one.len(), 3);
        let two = merge_calls(
            MergeCollective::Hierarchical,
            &NodeLayout::virtual_nodes(8, 2).unwrap(),
            4,
            8,
        );
        assert_eq!(two.len(), 5);
        assert!(two.iter().all(|c| c.group == 4 || c.group == 2));
    }

    #[test]
    fn latency_bound_links_choose_fewest_calls() {
        let flat = CallCost {
            latency_us: 10.0,
            gbps: 1e6,
        };
        let m = CostModel {
            all_reduce: flat,
            all_gather: flat,
        };
        let l = NodeLayout::single(4);
        assert_eq!(m.choose(&l, 16, 128), MergeCollective::Allgather);
        // Slow all-gathers of large states push the choice to the fused all-reduce.
        let m = CostModel {
            all_gather: CallCost {
                latency_us: 10.0,
                gbps: 0.001,
            },
            ..m
        };
        assert_eq!(m.choose(&l, 16, 128), MergeCollective::Allreduce2);
    }
}
