//! Whole-step predictions for rank counts that were not measured (the 8-GPU node from a 4-GPU
//! sweep, say), fitted to what `bench scaling` measured.
//!
//! A tree step on p ranks is one rank's attention over its shard, then the cross-rank merge:
//!
//! ```text
//! tree(p) = local(KV bytes per rank) + merge_fixed + Σ over the merge's NCCL calls of call(kind, g)
//! ring(p) = local(KV bytes per rank) + (p - 1) · hop(KV bytes per rank)
//! ```
//!
//! - `local` is a line in the shard's KV bytes (the kernel streams them), fitted on one-rank
//!   steps, where no collective runs.
//! - A call's time is a line in `g - 1` for a group of `g` ranks: NCCL's ring algorithms take
//!   a number of steps proportional to `g - 1`, and the merge's payloads (a few KB to ~100 KB per
//!   rank) are latency-bound, so bytes are left out. The calls are [`merge_calls`]' list, the
//!   same the `auto` collective prices.
//! - All-reduce's line comes from `allreduce3 - allreduce2` at each p (exactly one all-reduce
//!   more), `merge_fixed` from `allreduce2` less its two all-reduces, all-gather's line from
//!   `allgather` less `merge_fixed`. Reduce and broadcast are priced as all-reduces. The
//!   hierarchical form is not fitted: its prediction is a check of the call model.
//! - A ring hop is a line in the shard's bytes (latency + bytes / link bandwidth).
//!
//! A model's decode step ([`DecodeModel`], fitted to what `bench decode` measured) has the same
//! form with the step's layers folded in: what one rank does alone, then what several add.

use crate::cost::{merge_calls, CallKind};
use crate::{EngineError, MergeCollective, NodeLayout, Result, Strategy};
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};

/// `intercept + slope · x`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Line {
    pub intercept: f64,
    pub slope: f64,
}

impl Line {
    /// The weighted least-squares line through `points` of `(x, y, weight)`; flat through
    /// their weighted mean when every x is the same; `None` without weight.
    pub fn fit(points: &[(f64, f64, f64)]) -> Option<Line> {
        let w: f64 = points.iter().map(|p| p.2).sum();
        if w <= 0.0 {
            return None;
        }
        let mx = points.iter().map(|p| p.2 * p.0).sum::<f64>() / w;
        let my = points.iter().map(|p| p.2 * p.1).sum::<f64>() / w;
        let sxx: f64 = points.iter().map(|p| p.2 * (p.0 - mx) * (p.0 - mx)).sum();
        let sxy: f64 = points.iter().map(|p| p.2 * (p.0 - mx) * (p.1 - my)).sum();
        let slope = if sxx > 0.0 { sxy / sxx } else { 0.0 };
        Some(Line {
            intercept: my - slope * mx,
            slope,
        })
    }

    pub fn at(&self, x: f64) -> f64 {
        self.intercept + self.slope * x
    }
}

/// One measured step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepSample {
    pub strategy: Strategy,
    pub ranks: usize,
    pub kv_bytes_per_rank: u64,
    pub us: f64,
}

/// The fitted model (see the module notes). Times in microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct StepModel {
    /// One rank's attention by its KV bytes.
    pub local: Line,
    /// What a tree step on several ranks costs beyond attention and NCCL calls (the local
    /// combination of the states, stream ordering).
    pub merge_fixed_us: f64,
    /// One all-reduce (also reduce or broadcast) on g ranks, by g - 1.
    pub all_reduce: Line,
    /// One all-gather on g ranks, by g - 1.
    pub all_gather: Line,
    /// One ring hop by the bytes of the shard it carries.
    pub ring_hop: Line,
}

impl StepModel {
    /// Fits the model to `samples`: one-rank steps at two or more KV sizes, and steps on
    /// several ranks with `allreduce3`, `allreduce2` and `allgather` (and the ring, for its
    /// hop). Other samples are ignored.
    pub fn fit(samples: &[StepSample]) -> Result<StepModel> {
        let missing = |what: &str| {
            EngineError::Config(format!(
                "the scaling run has no {what}; fit the model to a `bench scaling` run with --ranks 1 and several other rank counts, every collective and the ring"
            ))
        };
        // A median's noise grows with the step's time, so every fit weighs a sample by 1/t²:
        // the small contexts pin the collectives' few microseconds, the large ones the slope.
        let weight = |s: &StepSample| 1.0 / (s.us * s.us);
        let one_rank: Vec<_> = samples
            .iter()
            .filter(|s| s.ranks == 1)
            .map(|s| (s.kv_bytes_per_rank as f64, s.us, weight(s)))
            .collect();
        let local = Line::fit(&one_rank).ok_or_else(|| missing("one-rank steps"))?;
        let beyond = |s: &StepSample| s.us - local.at(s.kv_bytes_per_rank as f64);
        // Time beyond local attention per (kind, ranks): the weighted mean over contexts.
        let mut sums: BTreeMap<(Strategy, usize), (f64, f64)> = BTreeMap::new();
        for s in samples.iter().filter(|s| s.ranks > 1) {
            let e = sums.entry((s.strategy, s.ranks)).or_default();
            e.0 += weight(s) * beyond(s);
            e.1 += weight(s);
        }
        let mean = |kind: MergeCollective, p: usize| {
            sums.get(&(Strategy::Tree(kind), p)).map(|(sum, w)| sum / w)
        };
        let ranks: BTreeSet<usize> = sums.keys().map(|k| k.1).collect();
        let both = |p: &usize| {
            Some((
                mean(MergeCollective::Allreduce3, *p)?,
                mean(MergeCollective::Allreduce2, *p)?,
            ))
        };
        let ar_points: Vec<_> = ranks
            .iter()
            .filter_map(|p| both(p).map(|(a3, a2)| ((p - 1) as f64, a3 - a2, 1.0)))
            .collect();
        let all_reduce =
            Line::fit(&ar_points).ok_or_else(|| missing("allreduce3 and allreduce2 steps"))?;
        let fixed: Vec<f64> = ranks
            .iter()
            .filter_map(|p| both(p).map(|(_, a2)| a2 - 2.0 * all_reduce.at((p - 1) as f64)))
            .collect();
        let merge_fixed_us = canopy_core::stats::mean(&fixed);
        let ag_points: Vec<_> = ranks
            .iter()
            .filter_map(|&p| {
                let t = mean(MergeCollective::Allgather, p)?;
                Some(((p - 1) as f64, t - merge_fixed_us, 1.0))
            })
            .collect();
        let all_gather = Line::fit(&ag_points).ok_or_else(|| missing("allgather steps"))?;
        let hops: Vec<_> = samples
            .iter()
            .filter(|s| s.strategy == Strategy::Ring && s.ranks > 1)
            .map(|s| {
                let hop = beyond(s) / (s.ranks - 1) as f64;
                (s.kv_bytes_per_rank as f64, hop, weight(s))
            })
            .collect();
        let ring_hop = Line::fit(&hops).ok_or_else(|| missing("ring steps"))?;
        Ok(StepModel {
            local,
            merge_fixed_us,
            all_reduce,
            all_gather,
            ring_hop,
        })
    }

    /// Predicted microseconds of one step of `strategy` on `layout`, merging `cells` states of
    /// dimension `d`, with `kv_bytes_per_rank` of KV on each rank. `Auto` is the cheapest form
    /// the layout allows, as the `auto` collective would pick with this model.
    pub fn predict(
        &self,
        strategy: Strategy,
        layout: &NodeLayout,
        cells: u64,
        d: u64,
        kv_bytes_per_rank: u64,
    ) -> f64 {
        let p = layout.ranks();
        let local = self.local.at(kv_bytes_per_rank as f64);
        if p <= 1 {
            return local;
        }
        match strategy {
            Strategy::Ring => local + (p - 1) as f64 * self.ring_hop.at(kv_bytes_per_rank as f64),
            Strategy::Tree(MergeCollective::Auto) => MergeCollective::CONCRETE
                .into_iter()
                .filter(|&c| c != MergeCollective::Hierarchical || layout.nodes() > 1)
                .map(|c| self.predict(Strategy::Tree(c), layout, cells, d, kv_bytes_per_rank))
                .fold(f64::INFINITY, f64::min),
            Strategy::Tree(how) => {
                let calls: f64 = merge_calls(how, layout, cells, d)
                    .iter()
                    .map(|c| {
                        let line = match c.kind {
                            CallKind::AllGather => &self.all_gather,
                            _ => &self.all_reduce,
                        };
                        line.at((c.group - 1) as f64)
                    })
                    .sum();
                local + self.merge_fixed_us + calls
            }
        }
    }
}

/// One measured decode step of a model: its rank count, the KV bytes one rank reads for a
/// token (its shard), and the step's milliseconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecodeSample {
    pub ranks: usize,
    pub kv_bytes_per_rank: f64,
    pub ms: f64,
}

/// A model's decode step on p ranks, in milliseconds a token:
///
/// ```text
/// tree(p) = local(KV bytes a rank reads) + across(p - 1)
/// ring(p) = local(KV bytes a rank reads) + (p - 1) · across(KV bytes of a shard)
/// ```
///
/// `local` is what one rank does alone (the weights' stream, every layer's kernels, the
/// attention over its shard): a line in the shard's bytes, fitted on one-rank steps, where the
/// tree and the ring run the same step. `across` is what several ranks add: for the tree, the
/// step's merges (one a layer, latency-bound NCCL calls whose steps grow with the group), a
/// line in p - 1; for the ring, the step's hand-offs of one shard, a line in its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct DecodeModel {
    pub strategy: Strategy,
    pub local: Line,
    pub across: Line,
}

impl DecodeModel {
    /// Fits `strategy`'s model: `local` to the one-rank samples (of any strategy) at two or
    /// more KV sizes, `across` to `strategy`'s samples on several ranks.
    pub fn fit(
        strategy: Strategy,
        one_rank: &[DecodeSample],
        several: &[DecodeSample],
    ) -> Result<DecodeModel> {
        let missing = |what: &str| {
            EngineError::Config(format!(
                "the decode runs have no {what} to fit {}'s model; fit it to `bench decode --json` runs at --ranks 1 (two contexts or more) and at more ranks",
                strategy.name()
            ))
        };
        // As StepModel weighs its samples: a median's noise grows with the step.
        let weight = |s: &DecodeSample| 1.0 / (s.ms * s.ms);
        let alone: Vec<_> = one_rank
            .iter()
            .filter(|s| s.ranks == 1)
            .map(|s| (s.kv_bytes_per_rank, s.ms, weight(s)))
            .collect();
        let sizes: BTreeSet<u64> = alone.iter().map(|p| p.0 as u64).collect();
        if sizes.len() < 2 {
            return Err(missing("one-rank steps at two KV sizes"));
        }
        let local = Line::fit(&alone).ok_or_else(|| missing("one-rank steps"))?;
        let points: Vec<_> = several
            .iter()
            .filter(|s| s.ranks > 1)
            .map(|s| {
                let beyond = s.ms - local.at(s.kv_bytes_per_rank);
                let peers = (s.ranks - 1) as f64;
                match strategy {
                    Strategy::Ring => (s.kv_bytes_per_rank, beyond / peers, weight(s)),
                    Strategy::Tree(_) => (peers, beyond, weight(s)),
                }
            })
            .collect();
        let across = Line::fit(&points).ok_or_else(|| missing("steps on several ranks"))?;
        Ok(DecodeModel {
            strategy,
            local,
            across,
        })
    }

    /// Predicted milliseconds of a step on `ranks` ranks, each reading `kv_bytes_per_rank`.
    pub fn predict(&self, ranks: usize, kv_bytes_per_rank: f64) -> f64 {
        let local = self.local.at(kv_bytes_per_rank);
        if ranks <= 1 {
            return local;
        }
        let peers = (ranks - 1) as f64;
        match self.strategy {
            Strategy::Ring => local + peers * self.across.at(kv_bytes_per_rank),
            Strategy::Tree(_) => local + self.across.at(peers),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_fit_recovers_a_line_and_flattens_one_x() {
        let l = Line::fit(&[(1.0, 3.0, 1.0), (2.0, 5.0, 2.0), (4.0, 9.0, 0.5)]).unwrap();
        assert!((l.slope - 2.0).abs() < 1e-12 && (l.intercept - 1.0).abs() < 1e-12);
        let flat = Line::fit(&[(3.0, 1.0, 1.0), (3.0, 4.0, 2.0)]).unwrap();
        assert_eq!((flat.intercept, flat.slope), (3.0, 0.0));
        assert!(Line::fit(&[]).is_none());
    }

    /// Samples generated by a known model are fitted back to it, and its prediction at a rank
    /// count outside the samples (8, with two nodes of 4 for the hierarchical form) is the
    /// model's own.
    #[test]
    fn fit_recovers_a_generating_model_and_extrapolates() {
        let truth = StepModel {
            local: Line {
                intercept: 12.0,
                slope: 1.0 / 4300.0,
            },
            merge_fixed_us: 6.0,
            all_reduce: Line {
                intercept: 3.0,
                slope: 1.5,
            },
            all_gather: Line {
                intercept: 4.0,
                slope: 2.5,
            },
            ring_hop: Line {
                intercept: 300.0,
                slope: 1.0 / 360.0,
            },
        };
        let (cells, d) = (16, 128);
        let mut samples = Vec::new();
        for n in [1u64 << 27, 1 << 30, 1 << 32] {
            for p in [1usize, 2, 4] {
                let layout = NodeLayout::single(p);
                let kinds = [
                    Strategy::Tree(MergeCollective::Allreduce3),
                    Strategy::Tree(MergeCollective::Allreduce2),
                    Strategy::Tree(MergeCollective::Allgather),
                    Strategy::Ring,
                ];
                for kind in kinds {
                    let kv = n / p as u64;
                    samples.push(StepSample {
                        strategy: kind,
                        ranks: p,
                        kv_bytes_per_rank: kv,
                        us: truth.predict(kind, &layout, cells, d, kv),
                    });
                }
            }
        }
        let fit = StepModel::fit(&samples).unwrap();
        let eight = NodeLayout::virtual_nodes(8, 2).unwrap();
        for kind in [
            Strategy::Tree(MergeCollective::Hierarchical),
            Strategy::Tree(MergeCollective::Auto),
            Strategy::Ring,
        ] {
            let (want, got) = (
                truth.predict(kind, &eight, cells, d, 1 << 29),
                fit.predict(kind, &eight, cells, d, 1 << 29),
            );
            assert!(
                (want - got).abs() < 1e-6 * want,
                "{kind:?}: {got} vs {want}"
            );
        }
    }

    /// Decode steps generated by known tree and ring models are fitted back to them, and the
    /// fits predict 8 ranks as the models do.
    #[test]
    fn decode_fit_recovers_generating_models() {
        let local = Line {
            intercept: 3.8,
            slope: 1.0 / 4.2e9,
        };
        for (strategy, across) in [
            (
                Strategy::Tree(MergeCollective::Auto),
                Line {
                    intercept: 0.55,
                    slope: 0.04,
                },
            ),
            (
                Strategy::Ring,
                Line {
                    intercept: 9.8,
                    slope: 1.0 / 2.6e8,
                },
            ),
        ] {
            let truth = DecodeModel {
                strategy,
                local,
                across,
            };
            let sample = |p: usize, context_kv: f64| DecodeSample {
                ranks: p,
                kv_bytes_per_rank: context_kv / p as f64,
                ms: truth.predict(p, context_kv / p as f64),
            };
            let contexts = [4.3e9, 8.6e9, 1.7e10, 3.4e10];
            let one: Vec<_> = contexts.iter().map(|&kv| sample(1, kv)).collect();
            let several: Vec<_> = [2, 4]
                .iter()
                .flat_map(|&p| contexts.iter().map(move |&kv| sample(p, kv)))
                .collect();
            let fit = DecodeModel::fit(strategy, &one, &several).unwrap();
            for kv in [2e9, 1.3e11] {
                let (want, got) = (truth.predict(8, kv / 8.0), fit.predict(8, kv / 8.0));
                assert!(
                    (want - got).abs() < 1e-9 * want,
                    "{strategy:?}: {got} vs {want}"
                );
            }
        }
    }

    #[test]
    fn decode_fit_needs_two_sizes_alone_and_several_ranks() {
        let tree = Strategy::Tree(MergeCollective::Auto);
        let s = |ranks, kv, ms| DecodeSample {
            ranks,
            kv_bytes_per_rank: kv,
            ms,
        };
        let err = DecodeModel::fit(tree, &[s(1, 1e9, 5.0)], &[s(2, 5e8, 5.0)]).unwrap_err();
        assert!(err.to_string().contains("two KV sizes"), "{err}");
        let alone = [s(1, 1e9, 5.0), s(1, 2e9, 6.0)];
        let err = DecodeModel::fit(tree, &alone, &[]).unwrap_err();
        assert!(err.to_string().contains("several ranks"), "{err}");
    }

    #[test]
    fn fit_names_what_is_missing() {
        let only_one_rank = [StepSample {
            strategy: Strategy::Ring,
            ranks: 1,
            kv_bytes_per_rank: 1 << 20,
            us: 10.0,
        }];
        let err = StepModel::fit(&only_one_rank).unwrap_err().to_string();
        assert!(err.contains("allreduce3"), "{err}");
    }
}
