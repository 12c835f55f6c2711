//! `auto`'s device model: what a plan costs on a GPU, in the shape of canopy's CUDA kernels,
//! and how its constants are fitted to measured steps.
//!
//! A plan is priced as the backend runs it: cut into CTAs by [`cut_for_gpu`] for the slots
//! [`cut_slots`] gives (fewer for plans of one-warp-per-head CTAs alone); groups of up to
//! 16 query rows run one warp per KV head (CTAs of four heads, 16-token tiles), larger groups
//! four warps per KV head in pieces of at most 64 rows, all sharing the GPU's CTA slots. Stage
//! 1 costs its bytes over bandwidth, or its CTA work over the slots, or its longest CTA (a
//! CTA's tiles run in order), whichever is largest, plus a share of the smaller of bandwidth
//! and work (the two overlap only in part). The merge is a second kernel after it: it reads
//! the partials back, and where one warp walks each (query, head) cell's partial rows
//! ([`merge_is_wide`]), the query with the most rows is a chain of memory latencies. A plan
//! whose partial rows are its queries has no merge. A fixed cost per step comes on top.
//!
//! The model is split in two so that it can be fitted: [`DeviceModel::measure`] counts a
//! plan's quantities once ([`PlanCost`]), and [`DeviceModel::price`] turns them into
//! microseconds. [`DeviceModel::fit`] adjusts the constants to measured `(quantities, time)`
//! samples without re-planning anything; `canopy fit-model` feeds it `canopy bench tree`'s
//! JSON.

use crate::error::{CoreError, Result};
use crate::geometry::{cut_for_gpu, cut_slots, merge_is_wide, runs_per_head, HEADS_PER_CTA};
use crate::plan::Plan;
use crate::shape::AttnShape;
use serde::{Deserialize, Serialize};

/// The constants of the price of a step. Defaults were fitted by `canopy fit-model` to one
/// draw of random trees timed on an H100 SXM (seed 2 of `bench tree --sweep`, 40 trees at six
/// head configurations, every method, cold L2: docs/device-runs/2026-11-24-s23/sweep/seed2),
/// and judged on the disjoint draw of seed 3 and on FastTree's public trees.
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
    /// per CTA and per 16-token tile on the one-warp-per-head path.
    pub main_cta_us: f64,
    pub main_tile_us: f64,
    pub heads_cta_us: f64,
    pub heads_tile_us: f64,
    /// Microseconds of one tile on a CTA's own (latency, not throughput): the floor a long
    /// group sets, however idle the rest of the GPU is. Per 64-token tile of the many-row
    /// kernel, per 16-token tile of the one-warp-per-head path, and per 64-token tile of a
    /// masked group, whose mask words are loaded and applied in the same chain.
    pub serial_tile_us: f64,
    pub serial_heads_tile_us: f64,
    pub serial_masked_tile_us: f64,
    /// Extra microseconds of CTA slot time per 64 tokens × CTA of a masked group (DeFT-Flatten's
    /// blocks across nodes): the mask words loaded and applied.
    pub masked_tile_us: f64,
    /// The share of the smaller of stage 1's streaming and its CTA work that does not overlap
    /// the larger: a CTA waits on its loads between tiles.
    pub overlap: f64,
    /// Fixed microseconds of the merge kernel, where a plan has one.
    pub merge_us: f64,
    /// Microseconds per partial row a merge warp walks in order (one cell's rows).
    pub merge_row_us: f64,
    pub multiprocessors: usize,
    pub ctas_per_sm: usize,
}

impl Default for DeviceModel {
    fn default() -> Self {
        DeviceModel {
            bytes_per_us: 2.93e6,
            l2_bytes_per_us: 6.21e6,
            us_per_step: 10.8,
            main_cta_us: 4.47,
            main_tile_us: 2.30,
            heads_cta_us: 1.6e-6,
            heads_tile_us: 0.900,
            serial_tile_us: 1.56,
            serial_heads_tile_us: 0.0910,
            serial_masked_tile_us: 2.32,
            masked_tile_us: 1.51,
            overlap: 0.135,
            merge_us: 0.255,
            merge_row_us: 0.141,
            multiprocessors: 132,
            ctas_per_sm: 3,
        }
    }
}

/// The quantities [`DeviceModel`] prices a plan by.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct PlanCost {
    /// Stage 1's distinct KV, query and partial bytes; KV bytes re-read.
    pub bytes: u64,
    pub reread_bytes: u64,
    /// The CTA slots the plan is cut for ([`cut_slots`]).
    pub slots: u64,
    /// Many-row CTAs and CTA × 64-token tiles; one-warp-per-head CTAs and CTA × 16-token
    /// tiles.
    pub main_ctas: u64,
    pub main_tiles: u64,
    pub heads_ctas: u64,
    pub heads_tiles: u64,
    /// Tiles of the longest CTA of each kernel, and 64-token tiles of the longest masked
    /// group: a group's tiles run in order.
    pub longest_main_tiles: u64,
    pub longest_heads_tiles: u64,
    pub longest_masked_tiles: u64,
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

/// The time constants [`DeviceModel::fit`] adjusts.
const CONSTANTS: usize = 14;

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

    /// The quantities of one decode step of `plan` as the CUDA backend cuts it for this
    /// model's GPU ([`cut_slots`]; `predicted_us` left at 0).
    pub fn measure(&self, plan: &Plan, shape: &AttnShape) -> PlanCost {
        let gqa = shape.group_size();
        let slots = cut_slots(plan, shape, self.multiprocessors, self.ctas_per_sm);
        let (plan, _) = cut_for_gpu(plan, shape, slots);
        let io = plan.io(shape, crate::DType::F16);
        let unique_kv = io.kv_unique_tokens * 2 * shape.kv_token_bytes(crate::DType::F16) as u64;
        // `partial_bytes` counts the partials written and read back once each.
        let merged = !plan.rows_are_queries();
        let partials = if merged { io.partial_bytes / 2 } else { 0 };
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
            bytes: unique_kv + io.q_bytes + partials,
            reread_bytes: io.kv_bytes - unique_kv,
            slots: slots as u64,
            merges: merged as u64,
            merge_bytes: partials,
            merge_rows,
            ..PlanCost::default()
        };
        for g in plan.groups() {
            let rows = g.queries.len() * gqa;
            let tokens = g.tokens() as u64;
            let per_head = runs_per_head(rows, shape.kv_heads);
            if g.mask.is_some() {
                let ctas = if per_head {
                    shape.kv_heads / HEADS_PER_CTA
                } else {
                    shape.kv_heads
                };
                c.masked_tiles += ctas as u64 * tokens.div_ceil(64);
                c.longest_masked_tiles = c.longest_masked_tiles.max(tokens.div_ceil(64));
            }
            if per_head {
                let tiles = tokens.div_ceil(16);
                let ctas = (shape.kv_heads / HEADS_PER_CTA) as u64;
                c.heads_ctas += ctas;
                c.heads_tiles += ctas * tiles;
                c.longest_heads_tiles = c.longest_heads_tiles.max(tiles);
            } else {
                let tiles = tokens.div_ceil(64);
                let ctas = shape.kv_heads as u64;
                c.main_ctas += ctas;
                c.main_tiles += ctas * tiles;
                c.longest_main_tiles = c.longest_main_tiles.max(tiles);
            }
        }
        c
    }

    /// Microseconds of a step with quantities `c`.
    pub fn price(&self, c: &PlanCost) -> f64 {
        let streaming =
            c.bytes as f64 / self.bytes_per_us + c.reread_bytes as f64 / self.l2_bytes_per_us;
        let work = (self.main_cta_us * c.main_ctas as f64
            + self.main_tile_us * c.main_tiles as f64
            + self.heads_cta_us * c.heads_ctas as f64
            + self.heads_tile_us * c.heads_tiles as f64
            + self.masked_tile_us * c.masked_tiles as f64)
            / c.slots.max(1) as f64;
        let longest = (self.serial_tile_us * c.longest_main_tiles as f64)
            .max(self.serial_heads_tile_us * c.longest_heads_tiles as f64)
            .max(self.serial_masked_tile_us * c.longest_masked_tiles as f64);
        let stage1 = streaming.max(work).max(longest) + self.overlap * streaming.min(work);
        let merge = self.merge_us * c.merges as f64
            + (c.merge_bytes as f64 / self.bytes_per_us)
                .max(self.merge_row_us * c.merge_rows as f64);
        stage1 + merge + self.us_per_step
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
            5 => &mut self.heads_cta_us,
            6 => &mut self.heads_tile_us,
            7 => &mut self.serial_tile_us,
            8 => &mut self.serial_heads_tile_us,
            9 => &mut self.serial_masked_tile_us,
            10 => &mut self.masked_tile_us,
            11 => &mut self.overlap,
            12 => &mut self.merge_us,
            _ => &mut self.merge_row_us,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::planner::{plan, Method, PlannerConfig};
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
        let floor = model.merge_us
            + (merged.merge_bytes as f64 / model.bytes_per_us)
                .max(model.merge_row_us * merged.merge_rows as f64);
        assert!(
            (merge_us - floor).abs() < 1e-9,
            "{merge_us} against {floor}"
        );
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
