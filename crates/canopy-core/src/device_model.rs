//! `auto`'s device model: what a plan costs on a GPU, in the shape of canopy's CUDA kernels,
//! and how its constants are fitted to measured steps.
//!
//! A plan is priced on the kernel the backend runs it on ([`runs_on_tensor_cores`], the rule the
//! backend's dispatch uses): plans whose groups all have one query row (one query per group at
//! 32/32 heads: Q-guided's paths), or a few where the KV heads do not come in fours, run on the
//! CUDA cores, a CTA per group and KV head, split by [`cut_for_cuda_cores`]; their re-read KV comes
//! from L2 faster than the tensor-core kernel's. Other plans are cut into CTAs by [`cut_for_gpu`]
//! for the slots [`cut_slots`] gives (fewer for plans of one-warp-per-head CTAs alone); groups of
//! up to 16 query rows run one warp per KV head (CTAs of four heads, 16-token tiles), larger groups
//! four warps per KV head in pieces of at most 64 rows, all sharing the GPU's CTA slots. Stage 1
//! costs its bytes over bandwidth, or its CTA work over the slots, or its longest CTA (a CTA's
//! tiles run in order), whichever is largest, plus a share of the smaller of bandwidth and work
//! (the two overlap only in part), plus a share of what the CTA that streams the most would take at
//! a fair share of the bandwidth beyond that (a plan of a few long CTAs among many short ones, as
//! FastTree's greedy grouping leaves, ends on its long ones). The merge is a second kernel after
//! it: it reads the partials back, and where one warp walks each (query, head) cell's partial rows
//! ([`merge_is_wide`]), the query with the most rows is a chain of memory latencies. A plan whose
//! partial rows are its queries has no merge. A fixed cost per step comes on top.
//!
//! `auto` keeps `q-guided`, its baseline, unless another plan is predicted faster by more
//! than the model's own typical error in that comparison ([`DeviceModel::pick`]).
//!
//! The model is split in two so that it can be fitted: [`DeviceModel::measure`] counts a
//! plan's quantities once ([`PlanCost`]), and [`DeviceModel::price`] turns them into
//! microseconds. [`DeviceModel::fit`] adjusts the constants to measured `(quantities, time)`
//! samples without re-planning anything; `canopy fit-model` feeds it `canopy bench tree`'s
//! JSON.

use crate::error::{CoreError, Result};
use crate::geometry::{
    cuda_core_slots, cut_for_cuda_cores, cut_for_gpu, cut_slots, max_cta_rows, merge_is_wide,
    runs_on_tensor_cores, runs_per_head, HEADS_PER_CTA, MAX_CTAS_PER_SM,
};
use crate::plan::{Plan, RowBytes};
use crate::planner::Method;
use crate::shape::AttnShape;
use crate::shard::TreeView;
use serde::{Deserialize, Serialize};

/// The constants of the price of a step. Defaults were fitted by `canopy fit-model` to two
/// draws of random trees timed on an H100 SXM (seeds 2 and 3 of `bench tree --sweep`, 40
/// trees at six head configurations each, every method, cold L2:
/// docs/device-runs/2026-11-24-s23/sweep), and judged on the disjoint draws of seeds 4 and 5
/// (docs/device-runs/2026-11-25-s26/sweep-ab) and on FastTree's public trees.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DeviceModel {
    /// Bytes per microsecond the kernels stream from HBM (distinct KV, queries, partials
    /// written and merged) and from L2 (KV re-read by several groups).
    pub bytes_per_us: f64,
    pub l2_bytes_per_us: f64,
    /// Fixed microseconds of a step (the launches).
    pub us_per_step: f64,
    /// Microseconds of CTA slot time: per CTA and per 64-token tile of the many-row kernel,
    /// per 16-token tile on the one-warp-per-head path (a per-CTA cost of that path fitted to
    /// 0 on every draw: its CTAs are the GPU's shortest).
    pub main_cta_us: f64,
    pub main_tile_us: f64,
    pub heads_tile_us: f64,
    /// Plans of groups of fewer than four rows run on the CUDA cores
    /// ([`runs_on_tensor_cores`]): bytes per microsecond of their KV re-read from L2 (the
    /// one-row kernel loads straight into registers: about 8 TB/s on an H100, against the
    /// tensor-core kernel's 6), microseconds of CTA slot time per CTA (one per group and KV
    /// head), and of one 64-token tile on its CTA's own chain.
    pub cuda_l2_bytes_per_us: f64,
    pub cuda_cta_us: f64,
    pub serial_cuda_tile_us: f64,
    /// Microseconds of one tile on a CTA's own (latency, not throughput): the floor a long
    /// group sets, however idle the rest of the GPU is. Per 64-token tile of the many-row
    /// kernel, and per 64-token tile of a masked group, whose mask words are loaded and
    /// applied in the same chain. (The one-warp-per-head path's chain, four heads' loads in
    /// flight, never bound a fit: a long CTA of it is priced by [`imbalance`](Self::imbalance).)
    pub serial_tile_us: f64,
    pub serial_masked_tile_us: f64,
    /// Extra microseconds of CTA slot time per 64 tokens × CTA of a masked group (DeFT-Flatten's
    /// blocks across nodes): the mask words loaded and applied.
    pub masked_tile_us: f64,
    /// The share of the smaller of stage 1's streaming and its CTA work that does not overlap
    /// the larger: a CTA waits on its loads between tiles.
    pub overlap: f64,
    /// The share of the longest CTA's excess over the rest that shows: the time the longest
    /// CTA would take streaming at a fair share of the bandwidth (its bytes times the CTAs
    /// that run beside it) over stage 1's time otherwise. Its neighbours finish early and it
    /// speeds up, so only part of it.
    pub imbalance: f64,
    /// Microseconds per partial row a merge warp walks in order (one cell's rows).
    pub merge_row_us: f64,
    /// How much faster than `q-guided` another plan must be predicted, as a log ratio, to be
    /// picked instead ([`pick`](Self::pick)): the model's typical error in that very
    /// comparison on the draws it was fitted to ([`q_guided_margin`](Self::q_guided_margin)),
    /// not a constant of the time. Q-guided is the baseline `auto` must never lose to.
    pub q_guided_margin: f64,
    pub multiprocessors: usize,
    /// Resident CTAs per SM of the tensor-core kernel, and of the one-row CUDA-core kernel
    /// under the backend's cap ([`MAX_CTAS_PER_SM`]).
    pub ctas_per_sm: usize,
    pub cuda_core_ctas_per_sm: usize,
}

impl Default for DeviceModel {
    fn default() -> Self {
        DeviceModel {
            bytes_per_us: 2.90e6,
            l2_bytes_per_us: 5.51e6,
            us_per_step: 10.59,
            main_cta_us: 4.79,
            main_tile_us: 2.39,
            heads_tile_us: 0.909,
            cuda_l2_bytes_per_us: 7.84e6,
            cuda_cta_us: 2.48,
            serial_cuda_tile_us: 2.41,
            serial_tile_us: 1.66,
            serial_masked_tile_us: 2.51,
            masked_tile_us: 0.765,
            overlap: 0.113,
            imbalance: 0.0697,
            merge_row_us: 0.142,
            q_guided_margin: 0.0655,
            multiprocessors: 132,
            ctas_per_sm: 3,
            cuda_core_ctas_per_sm: MAX_CTAS_PER_SM,
        }
    }
}

/// The quantities [`DeviceModel`] prices a plan by.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct PlanCost {
    /// Stage 1's distinct KV, query and partial bytes; KV bytes re-read by the tensor-core
    /// kernel, and by the CUDA-core kernel.
    pub bytes: u64,
    pub reread_bytes: u64,
    pub cuda_reread_bytes: u64,
    /// The CTA slots the plan is cut for ([`cut_slots`], [`cuda_core_slots`]), and its CTAs.
    pub slots: u64,
    pub ctas: u64,
    /// Many-row CTAs and CTA × 64-token tiles; one-warp-per-head CTA × 16-token tiles;
    /// CUDA-core CTAs (0 where the plan runs on tensor cores).
    pub main_ctas: u64,
    pub main_tiles: u64,
    pub heads_tiles: u64,
    pub cuda_ctas: u64,
    /// 64-token tiles of the longest many-row CTA, CUDA-core CTA and masked group: a group's
    /// tiles run in order.
    pub longest_main_tiles: u64,
    pub longest_cuda_tiles: u64,
    pub longest_masked_tiles: u64,
    /// KV bytes the CTA that streams the most streams, and the KV bytes of all CTAs (re-reads
    /// included).
    pub longest_cta_bytes: u64,
    pub kv_bytes: u64,
    /// CTA × 64-token tiles of masked groups, on either path.
    pub masked_tiles: u64,
    /// Merges: 1, or 0 where stage 1 writes the output. The partial bytes the merge reads, and
    /// the partial rows of the query with the most where one warp walks each cell's rows (0
    /// where the wide merge does).
    pub merges: u64,
    pub merge_bytes: u64,
    pub merge_rows: u64,
    pub predicted_us: f64,
}

/// What a plan moves, as the device model counts it (16-bit KV and queries): its KV in all,
/// its distinct KV, the KV read again, its queries, and its partial rows where they merge
/// (written once and read back once).
struct PlanBytes {
    kv: u64,
    unique_kv: u64,
    reread: u64,
    q: u64,
    partials: u64,
}

impl PlanBytes {
    fn of(plan: &Plan, shape: &AttnShape) -> PlanBytes {
        let io = plan.io(shape, crate::DType::F16);
        let unique_kv = io.kv_unique_tokens * 2 * shape.kv_token_bytes(crate::DType::F16) as u64;
        PlanBytes {
            kv: io.kv_bytes,
            unique_kv,
            reread: io.kv_bytes.saturating_sub(unique_kv),
            q: io.q_bytes,
            // `partial_bytes` counts the partials written and read back once each.
            partials: match plan.rows_are_queries() {
                true => 0,
                false => io.partial_bytes / 2,
            },
        }
    }

    /// What Q-guided's plan of whole paths ([`crate::planner::auto_candidates`]' Q-guided)
    /// moves, counted on the view without making the plan: each query one group of its whole
    /// context on this rank, none for a query whose context here is empty. Nodes' KV ranges
    /// are disjoint, so the distinct KV is that of the nodes some query reads.
    fn of_q_guided(view: &TreeView, shape: &AttnShape) -> PlanBytes {
        let tree = view.tree;
        let bytes = RowBytes::of(shape, crate::DType::F16);
        let (mut kv_tokens, mut unique_tokens) = (0u64, 0u64);
        // Whether a node's path holds any KV on this rank; parents come first in DFS order.
        let mut reaches_kv = vec![false; tree.nodes().len()];
        for &n in tree.dfs_order() {
            let len = view.node_kv(n).len() as u64;
            let readers = tree.queries_through(n).len() as u64;
            kv_tokens += len * readers;
            if readers > 0 {
                unique_tokens += len;
            }
            let parent = tree.node(n).parent.is_some_and(|p| reaches_kv[p as usize]);
            reaches_kv[n as usize] = parent || len > 0;
        }
        let rows = (0..tree.num_queries() as u32)
            .filter(|&q| reaches_kv[tree.query_node(q) as usize])
            .count() as u64;
        let (kv, unique_kv) = (kv_tokens * bytes.kv_token, unique_tokens * bytes.kv_token);
        PlanBytes {
            kv,
            unique_kv,
            reread: kv.saturating_sub(unique_kv),
            q: rows * bytes.q_row,
            // Every query its own one row: no merge, unless a query has none.
            partials: match rows == tree.num_queries() as u64 {
                true => 0,
                false => rows * bytes.partial_row,
            },
        }
    }
}

/// The time constants [`DeviceModel::fit`] adjusts.
const CONSTANTS: usize = 15;

/// One measured step: a plan's quantities and the time it took.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    pub cost: PlanCost,
    pub measured_us: f64,
}

impl DeviceModel {
    /// The model in `path` (TOML, as `canopy fit-model --out` writes; missing constants keep
    /// their defaults), or the built-in one.
    pub fn load_or_default(path: Option<&std::path::Path>) -> Result<DeviceModel> {
        let Some(path) = path else {
            return Ok(DeviceModel::default());
        };
        let fail = |reason: String| CoreError::DeviceModelFile {
            path: path.display().to_string(),
            reason,
        };
        let text = std::fs::read_to_string(path).map_err(|e| fail(e.to_string()))?;
        toml::from_str(&text).map_err(|e| fail(e.to_string()))
    }

    /// The quantities of one decode step of `plan`, and its predicted microseconds.
    pub fn cost(&self, plan: &Plan, shape: &AttnShape) -> PlanCost {
        let mut c = self.measure(plan, shape);
        c.predicted_us = self.price(&c);
        c
    }

    /// Predicted microseconds of one decode step of `plan`.
    pub fn predict_us(&self, plan: &Plan, shape: &AttnShape) -> f64 {
        self.cost(plan, shape).predicted_us
    }

    /// A floor under [`predict_us`](Self::predict_us) from the plan as it is, not cut for the
    /// GPU: its distinct KV, each row's query and, where rows merge, each row's partial
    /// (written, then read by the merge) at the copy bandwidth, and its KV read again at the
    /// faster of the two L2 rates. The cut keeps the distinct KV and only adds rows and reads.
    /// Cheap where the prediction is not: a plan of a hundred thousand partial rows (a
    /// flattened prefix under thousands of prompt rows) takes milliseconds to cut.
    pub fn floor_us(&self, plan: &Plan, shape: &AttnShape) -> f64 {
        self.floor_of(&PlanBytes::of(plan, shape))
    }

    /// [`DeviceModel::floor_us`] of Q-guided's plan of whole paths on `view`, without making
    /// that plan (a group per query: thousands, under a pass of prompt rows).
    pub fn q_guided_floor_us(&self, view: &TreeView, shape: &AttnShape) -> f64 {
        self.floor_of(&PlanBytes::of_q_guided(view, shape))
    }

    fn floor_of(&self, b: &PlanBytes) -> f64 {
        let l2_bytes_per_us = self.l2_bytes_per_us.max(self.cuda_l2_bytes_per_us);
        (b.unique_kv + b.q + 2 * b.partials) as f64 / self.bytes_per_us
            + b.reread as f64 / l2_bytes_per_us
            + self.us_per_step
    }

    /// The quantities of one decode step of `plan` on the kernel the CUDA backend runs it on
    /// ([`runs_on_tensor_cores`]), cut as the backend cuts it for this model's GPU
    /// ([`cut_slots`], [`cuda_core_slots`]; `predicted_us` left at 0).
    pub fn measure(&self, plan: &Plan, shape: &AttnShape) -> PlanCost {
        let gqa = shape.group_size();
        let max_rows = max_cta_rows(plan, shape);
        let tensor_cores = runs_on_tensor_cores(shape, max_rows);
        let sms = self.multiprocessors;
        let (slots, plan) = if tensor_cores {
            let slots = cut_slots(plan, shape, sms, self.ctas_per_sm);
            (slots, cut_for_gpu(plan, shape, slots).0)
        } else {
            let slots = cuda_core_slots(max_rows, sms, self.cuda_core_ctas_per_sm);
            (slots, cut_for_cuda_cores(plan, shape, slots))
        };
        let b = PlanBytes::of(&plan, shape);
        let merged = !plan.rows_are_queries();
        let cells = plan.num_queries() * shape.q_heads;
        let merge_rows = if !merged || merge_is_wide(cells, shape.head_dim, self.multiprocessors) {
            0
        } else {
            (0..plan.num_queries())
                .map(|q| plan.rows_of(q).len())
                .max()
                .unwrap_or(0) as u64
        };
        let mut c = PlanCost {
            bytes: b.unique_kv + b.q + b.partials,
            reread_bytes: if tensor_cores { b.reread } else { 0 },
            cuda_reread_bytes: if tensor_cores { 0 } else { b.reread },
            slots: slots as u64,
            merges: merged as u64,
            merge_bytes: b.partials,
            merge_rows,
            kv_bytes: b.kv,
            ..PlanCost::default()
        };
        let head_token_bytes = 2 * shape.head_dim as u64 * crate::DType::F16.size_bytes() as u64;
        for g in plan.groups() {
            let rows = g.queries.len() * gqa;
            let tokens = g.tokens() as u64;
            let per_head = tensor_cores && runs_per_head(rows, shape.kv_heads);
            let (ctas, heads) = if per_head {
                (shape.kv_heads / HEADS_PER_CTA, HEADS_PER_CTA)
            } else {
                (shape.kv_heads, 1)
            };
            let ctas = ctas as u64;
            let tiles = tokens.div_ceil(64);
            c.ctas += ctas;
            c.longest_cta_bytes = c
                .longest_cta_bytes
                .max(tokens * heads as u64 * head_token_bytes);
            if g.mask.is_some() {
                c.masked_tiles += ctas * tiles;
                c.longest_masked_tiles = c.longest_masked_tiles.max(tiles);
            }
            if !tensor_cores {
                c.cuda_ctas += ctas;
                c.longest_cuda_tiles = c.longest_cuda_tiles.max(tiles);
            } else if per_head {
                c.heads_tiles += ctas * tokens.div_ceil(16);
            } else {
                c.main_ctas += ctas;
                c.main_tiles += ctas * tiles;
                c.longest_main_tiles = c.longest_main_tiles.max(tiles);
            }
        }
        c
    }

    /// Microseconds of a step with quantities `c`.
    pub fn price(&self, c: &PlanCost) -> f64 {
        let streaming = c.bytes as f64 / self.bytes_per_us
            + c.reread_bytes as f64 / self.l2_bytes_per_us
            + c.cuda_reread_bytes as f64 / self.cuda_l2_bytes_per_us;
        let work = (self.main_cta_us * c.main_ctas as f64
            + self.main_tile_us * c.main_tiles as f64
            + self.heads_tile_us * c.heads_tiles as f64
            + self.cuda_cta_us * c.cuda_ctas as f64
            + self.masked_tile_us * c.masked_tiles as f64)
            / c.slots.max(1) as f64;
        let longest = (self.serial_tile_us * c.longest_main_tiles as f64)
            .max(self.serial_cuda_tile_us * c.longest_cuda_tiles as f64)
            .max(self.serial_masked_tile_us * c.longest_masked_tiles as f64);
        let stage1 = streaming.max(work).max(longest) + self.overlap * streaming.min(work);
        let fair = streaming * c.longest_cta_bytes as f64 * c.ctas.min(c.slots) as f64
            / c.kv_bytes.max(1) as f64;
        let stage1 = stage1 + self.imbalance * (fair - stage1).max(0.0);
        // The merge kernel's launch is in `us_per_step`: a fixed cost of its own fitted to 0.
        let merge =
            (c.merge_bytes as f64 / self.bytes_per_us).max(self.merge_row_us * c.merge_rows as f64);
        stage1 + merge + self.us_per_step
    }

    /// Which of `candidates` (each a method and its predicted microseconds) `auto` runs: the
    /// fastest predicted, unless `q-guided` is among them and that one is not predicted
    /// faster than it by [`q_guided_margin`](Self::q_guided_margin). Ties go to the first.
    pub fn pick(&self, candidates: &[(Method, f64)]) -> Option<usize> {
        let fastest = (0..candidates.len()).min_by(|&a, &b| {
            let (a, b) = (candidates[a].1, candidates[b].1);
            a.total_cmp(&b)
        })?;
        let q_guided = candidates.iter().position(|c| c.0 == Method::QGuided);
        Some(match q_guided {
            Some(q) if (candidates[q].1 / candidates[fastest].1).ln() <= self.q_guided_margin => q,
            _ => fastest,
        })
    }

    /// The candidates to time where the clock settles `auto`: those the model cannot tell
    /// apart from the fastest predicted (within twice [`q_guided_margin`](Self::q_guided_margin)
    /// of it, as a log ratio), [`pick`](Self::pick)'s choice, and `q-guided`, the baseline
    /// `auto` must never lose to; indices in the candidates' order. One index: nothing to
    /// time.
    pub fn shortlist(&self, candidates: &[(Method, f64)]) -> Vec<usize> {
        let Some(pick) = self.pick(candidates) else {
            return Vec::new();
        };
        let fastest = candidates.iter().map(|c| c.1).fold(f64::INFINITY, f64::min);
        (0..candidates.len())
            .filter(|&i| {
                i == pick
                    || candidates[i].0 == Method::QGuided
                    || (candidates[i].1 / fastest).ln() <= 2.0 * self.q_guided_margin
            })
            .collect()
    }

    /// The median over `trees` (each its methods' measured steps) and over their methods
    /// other than `q-guided` of |ln(predicted ratio to q-guided / measured ratio)|: how far
    /// the model typically misjudges a plan against q-guided, which is what a pick against it
    /// risks. Trees without a measured q-guided are skipped; 0 where none has one.
    pub fn q_guided_margin<'a>(
        &self,
        trees: impl IntoIterator<Item = &'a [(Method, Sample)]>,
    ) -> f64 {
        let mut errors: Vec<f64> = trees
            .into_iter()
            .filter_map(|t| Some((t, t.iter().find(|x| x.0 == Method::QGuided)?.1)))
            .flat_map(|(t, q)| {
                let (q_predicted, q_measured) = (self.price(&q.cost), q.measured_us);
                t.iter().filter(|x| x.0 != Method::QGuided).map(move |x| {
                    let predicted = self.price(&x.1.cost) / q_predicted;
                    (predicted / (x.1.measured_us / q_measured)).ln().abs()
                })
            })
            .collect();
        if errors.is_empty() {
            return 0.0;
        }
        errors.sort_by(f64::total_cmp);
        errors[errors.len() / 2]
    }

    /// Root-mean-square of ln(predicted / measured) over `samples`: 0.1 is about 10% off.
    pub fn log_error(&self, samples: &[Sample]) -> f64 {
        let sum: f64 = samples
            .iter()
            .map(|s| (self.price(&s.cost) / s.measured_us).ln().powi(2))
            .sum();
        (sum / samples.len().max(1) as f64).sqrt()
    }

    /// The time constants (bandwidths, per-step, per-CTA and per-tile costs) that minimise
    /// [`log_error`](Self::log_error) over `samples`, starting from `self`; the GPU's size
    /// stays as it is. Relative error, not absolute: `auto` compares plans of one tree, so a
    /// 20 µs tree deserves the same weight as a 2 ms one. The price is a maximum of terms, so
    /// the error is not smooth; coordinate descent on the logarithms of the constants, with
    /// shrinking steps, finds a good minimum without derivatives.
    pub fn fit(&self, samples: &[Sample]) -> DeviceModel {
        self.fit_by(|m| m.log_error(samples))
    }

    /// The time constants that minimise `objective`, starting from `self`, by the coordinate
    /// descent of [`fit`](Self::fit); the GPU's size stays as it is.
    pub fn fit_by(&self, objective: impl Fn(&DeviceModel) -> f64) -> DeviceModel {
        let mut best = *self;
        let mut err = objective(&best);
        for step in [0.5f64, 0.2, 0.05, 0.01] {
            loop {
                let mut improved = false;
                for i in 0..CONSTANTS {
                    for dir in [1.0, -1.0] {
                        let mut m = best;
                        *m.constant_mut(i) *= (dir * step).exp();
                        let e = objective(&m);
                        if e < err - 1e-12 {
                            (best, err, improved) = (m, e, true);
                        }
                    }
                }
                if !improved {
                    break;
                }
            }
        }
        best
    }

    fn constant_mut(&mut self, i: usize) -> &mut f64 {
        match i {
            0 => &mut self.bytes_per_us,
            1 => &mut self.l2_bytes_per_us,
            2 => &mut self.us_per_step,
            3 => &mut self.main_cta_us,
            4 => &mut self.main_tile_us,
            5 => &mut self.heads_tile_us,
            6 => &mut self.serial_tile_us,
            7 => &mut self.serial_masked_tile_us,
            8 => &mut self.masked_tile_us,
            9 => &mut self.overlap,
            10 => &mut self.merge_row_us,
            11 => &mut self.cuda_l2_bytes_per_us,
            12 => &mut self.cuda_cta_us,
            13 => &mut self.serial_cuda_tile_us,
            _ => &mut self.imbalance,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::planner::{plan, PlannerConfig};
    use crate::shard::{Shard, TreeView};
    use crate::tree::fan;

    #[test]
    fn fit_by_descends_on_any_objective() {
        let target = 2.0e6f64;
        let start = DeviceModel::default();
        let fitted = start.fit_by(|m| (m.bytes_per_us / target).ln().powi(2));
        assert!(
            (fitted.bytes_per_us / target - 1.0).abs() < 0.01,
            "{fitted:?}"
        );
        assert_eq!(
            fitted.us_per_step, start.us_per_step,
            "other constants stay"
        );
        assert_eq!(fitted.multiprocessors, start.multiprocessors);
    }

    #[test]
    fn q_guided_rereads_are_counted_once_as_unique_kv() {
        let shape = AttnShape::new(32, 8, 128).unwrap();
        let t = fan(1000, 4, 10);
        let shard = Shard::whole(&t);
        let view = TreeView::new(&t, &shard);
        let cfg = PlannerConfig::whole_paths();
        let q = plan(&view, Method::QGuided, &shape, &cfg).unwrap();
        let io = q.io(&shape, crate::DType::F16);
        assert_eq!(io.kv_tokens_read, 4 * 1010);
        assert_eq!(io.kv_unique_tokens, 1040);
        let cost = DeviceModel::default().cost(&q, &shape);
        assert!(cost.reread_bytes > 0 && cost.reread_bytes < cost.bytes * 4);
    }

    #[test]
    fn the_model_prices_a_long_shared_root_as_the_backend_cuts_it() {
        // Few-shot b = 50 planned per node: one group of 50 queries over a 4000-token root.
        // Run whole, each of its CTAs would walk all 4000 tokens in order (measured on H100
        // before the backend cut long groups: 234 µs, against 84 µs chunked); the backend now
        // cuts it (`geometry::cut_for_gpu`), and the model must price the pieces.
        let shape = AttnShape::new(32, 8, 128).unwrap();
        let model = DeviceModel::default();
        let t = fan(4000, 50, 200);
        let shard = Shard::whole(&t);
        let view = TreeView::new(&t, &shard);
        let node = plan(&view, Method::DeftNode, &shape, &PlannerConfig::default()).unwrap();
        let cost = model.cost(&node, &shape);
        assert!(
            cost.longest_main_tiles * 64 <= 1000,
            "the longest many-row CTA walks {} tiles",
            cost.longest_main_tiles
        );
    }

    /// The merge is a kernel after stage 1: a plan whose partial rows are its queries has
    /// none, and a merged plan pays for reading its partials back and for the longest walk of
    /// one query's rows, on top of stage 1.
    #[test]
    fn the_merge_is_priced_after_stage_1() {
        let shape = AttnShape::new(32, 8, 128).unwrap();
        let model = DeviceModel::default();
        let t = fan(16, 400, 16);
        let shard = Shard::whole(&t);
        let view = TreeView::new(&t, &shard);
        let cfg = PlannerConfig::whole_paths();
        let direct = model.cost(&plan(&view, Method::QGuided, &shape, &cfg).unwrap(), &shape);
        assert_eq!((direct.merges, direct.merge_bytes), (0, 0));

        // Few queries, each with dozens of partial rows: one warp walks each cell's rows.
        let t = fan(8000, 10, 100);
        let shard = Shard::whole(&t);
        let view = TreeView::new(&t, &shard);
        let chunked = plan(&view, Method::DeftNodeChunk, &shape, &cfg).unwrap();
        let merged = model.cost(&chunked, &shape);
        assert_eq!(merged.merges, 1);
        assert!(merged.merge_rows > 10, "{merged:?}");
        let stage1_only = PlanCost {
            merges: 0,
            merge_bytes: 0,
            merge_rows: 0,
            ..merged
        };
        let merge_us = model.price(&merged) - model.price(&stage1_only);
        let floor = (merged.merge_bytes as f64 / model.bytes_per_us)
            .max(model.merge_row_us * merged.merge_rows as f64);
        assert!(
            (merge_us - floor).abs() < 1e-9,
            "{merge_us} against {floor}"
        );
    }

    /// One query per group at 32/32 heads runs on the CUDA cores (the backend's rule,
    /// [`runs_on_tensor_cores`]), and the model prices that kernel: its CTAs and its re-reads
    /// from L2, none of the tensor-core kernel's. The same tree at 32/8 (four rows a group)
    /// runs on tensor cores.
    #[test]
    fn the_model_prices_the_cuda_core_kernel_where_the_backend_runs_it() {
        let model = DeviceModel::default();
        let t = fan(2000, 16, 100);
        let shard = Shard::whole(&t);
        let view = TreeView::new(&t, &shard);
        let cfg = PlannerConfig::whole_paths();
        let mha = AttnShape::new(32, 32, 128).unwrap();
        let q = plan(&view, Method::QGuided, &mha, &cfg).unwrap();
        assert!(!runs_on_tensor_cores(&mha, max_cta_rows(&q, &mha)));
        let c = model.cost(&q, &mha);
        assert_eq!(c.cuda_ctas, 16 * 32, "a CTA per path and KV head: {c:?}");
        assert_eq!((c.main_ctas, c.heads_tiles, c.reread_bytes), (0, 0, 0));
        assert!(c.cuda_reread_bytes > 0 && c.longest_cuda_tiles == 2100u64.div_ceil(64));
        assert_eq!(c.slots, 132 * MAX_CTAS_PER_SM as u64);
        // Priced faster than the same quantities re-read at the tensor-core kernel's rate.
        let as_tensor_cores = PlanCost {
            reread_bytes: c.cuda_reread_bytes,
            cuda_reread_bytes: 0,
            ..c
        };
        assert!(model.price(&c) < model.price(&as_tensor_cores));

        let gqa = AttnShape::new(32, 8, 128).unwrap();
        let q = plan(&view, Method::QGuided, &gqa, &cfg).unwrap();
        let c = model.cost(&q, &gqa);
        assert_eq!((c.cuda_ctas, c.cuda_reread_bytes), (0, 0));
        assert!(c.heads_tiles > 0, "{c:?}");
    }

    /// `auto` keeps q-guided unless another plan is predicted faster by more than the margin,
    /// and picks the fastest where q-guided is not a candidate.
    #[test]
    fn q_guided_is_kept_within_the_margin() {
        let model = DeviceModel {
            q_guided_margin: 0.05,
            ..DeviceModel::default()
        };
        let close = [(Method::QGuided, 100.0), (Method::DeftNode, 96.0)];
        assert_eq!(model.pick(&close), Some(0));
        let far = [(Method::DeftNode, 90.0), (Method::QGuided, 100.0)];
        assert_eq!(model.pick(&far), Some(0));
        let slower = [(Method::FastTree, 120.0), (Method::QGuided, 100.0)];
        assert_eq!(model.pick(&slower), Some(1));
        let none = [(Method::FastTree, 20.0), (Method::DeftNode, 19.0)];
        assert_eq!(model.pick(&none), Some(1));
        assert_eq!(model.pick(&[]), None);
    }

    /// The shortlist holds the plans predicted within twice the margin of the fastest, the
    /// pick, and q-guided.
    #[test]
    fn the_shortlist_is_what_the_model_cannot_tell_apart() {
        let model = DeviceModel {
            q_guided_margin: 0.05,
            ..DeviceModel::default()
        };
        // Within 2 × 0.05 of 100: up to 110.5.
        let spread = [
            (Method::FastTree, 100.0),
            (Method::DeftNode, 110.0),
            (Method::DeftFlatten, 111.0),
            (Method::QGuided, 150.0),
        ];
        assert_eq!(model.shortlist(&spread), [0, 1, 3]);
        let sure = [(Method::FastTree, 50.0), (Method::DeftNode, 100.0)];
        assert_eq!(model.shortlist(&sure), [0]);
        let baseline = [(Method::FastTree, 50.0), (Method::QGuided, 100.0)];
        assert_eq!(model.shortlist(&baseline), [0, 1]);
        let kept = [(Method::QGuided, 100.0), (Method::DeftNode, 96.0)];
        assert_eq!(model.shortlist(&kept), [0, 1]);
        assert!(model.shortlist(&[]).is_empty());
    }

    /// The margin is the median misjudgement of a plan against q-guided: a plan measured 10%
    /// slower relative to q-guided than predicted counts ln(1.1), whichever way.
    #[test]
    fn the_margin_is_the_median_error_against_q_guided() {
        let model = DeviceModel::default();
        let t = fan(1000, 8, 50);
        let shard = Shard::whole(&t);
        let view = TreeView::new(&t, &shard);
        let shape = AttnShape::new(32, 8, 128).unwrap();
        let cfg = PlannerConfig::whole_paths();
        let sample = |m: Method, off: f64| {
            let cost = model.measure(&plan(&view, m, &shape, &cfg).unwrap(), &shape);
            let measured_us = model.price(&cost) * off;
            (m, Sample { cost, measured_us })
        };
        let trees = [
            vec![
                sample(Method::QGuided, 1.0),
                sample(Method::DeftNode, 1.1),
                sample(Method::FastTree, 1.0 / 1.3),
            ],
            vec![sample(Method::QGuided, 2.0), sample(Method::DeftNode, 2.0)],
            vec![sample(Method::DeftNode, 5.0)],
        ];
        let margin = model.q_guided_margin(trees.iter().map(|t| t.as_slice()));
        assert!((margin - 1.1f64.ln()).abs() < 1e-9, "{margin}");
    }

    /// Samples priced by a known model are fitted back to (nearly) no error from a start
    /// that is off by 2x in every constant, and the fit never ends worse than it started.
    #[test]
    fn fitting_recovers_the_model_that_priced_the_samples() {
        let truth = DeviceModel::default();
        let mut samples = Vec::new();
        for ((root, leaves, leaf), (q_heads, kv_heads)) in [
            (4000, 50, 200),
            (256, 256, 32),
            (2048, 1024, 32),
            (1, 1, 60000),
            (16, 400, 16),
            (8000, 10, 100),
        ]
        .into_iter()
        .flat_map(|fan| [(fan, (32, 8)), (fan, (32, 32)), (fan, (16, 1))])
        {
            let shape = AttnShape::new(q_heads, kv_heads, 128).unwrap();
            let t = fan(root, leaves, leaf);
            let shard = Shard::whole(&t);
            let view = TreeView::new(&t, &shard);
            for m in Method::ALL {
                let p = plan(&view, m, &shape, &PlannerConfig::whole_paths()).unwrap();
                let cost = truth.measure(&p, &shape);
                samples.push(Sample {
                    cost,
                    measured_us: truth.price(&cost),
                });
            }
        }
        let mut start = truth;
        for i in 0..CONSTANTS {
            *start.constant_mut(i) *= if i % 2 == 0 { 2.0 } else { 0.5 };
        }
        let before = start.log_error(&samples);
        let fitted = start.fit(&samples);
        let after = fitted.log_error(&samples);
        assert!(before > 0.2, "the start is off ({before})");
        assert!(after < 0.02, "fitted error {after} (from {before})");
    }
}
