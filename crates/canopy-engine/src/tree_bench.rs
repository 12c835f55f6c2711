//! Every planning method on one tree, on any [`Backend`]: the body of `canopy bench tree`.
//!
//! For each method the tree is planned (timed on the host: planning sits on the decode path of
//! a growing tree), uploaded, run once into poisoned buffers and checked against the oracle;
//! then every method is timed with the backend's own clock ([`Backend::time_steps`]: CUDA
//! events on a GPU), round-robin, so that two methods (or two runs of one plan) are timed
//! under the same conditions. The analytic IO of the host plan is reported beside the time,
//! and speedups are over Q-guided.

use crate::backend::{time_round_robin, Backend, Cache};
use crate::timed_auto::choose_timed;
use crate::Result;
use canopy_core::stats::{median, quantile};
use canopy_core::{
    choose, plan, relative_error, AttnShape, DType, DeviceModel, IoReport, Method, Plan,
    PlannerConfig, TreeView,
};
use serde::Serialize;
use std::time::Instant;

/// Timed runs of each plan on `auto`'s shortlist, when the clock settles it: two in each of
/// the round-robin's rounds.
const TIMED_AUTO_RUNS: usize = 2 * crate::backend::TIMING_ROUNDS;

/// One method's measurement.
#[derive(Debug, Clone, Serialize)]
pub struct MethodRun {
    pub method: Method,
    /// For `auto`: the method it chose, and the time its model predicted.
    pub chosen: Option<Method>,
    pub predicted_us: Option<f64>,
    /// Host time to plan the tree (every candidate, for `auto`).
    pub plan_ms: f64,
    /// Analytic IO of the plan as planned (before the backend re-splits it).
    pub io: IoReport,
    pub median_us: f64,
    pub p10_us: f64,
    pub p90_us: f64,
    /// Median of stage 1 alone (the partials), timed separately; the rest is stage 2. Not
    /// measured across ranks.
    pub stage1_us: Option<f64>,
    /// Q-guided's median over this method's (when Q-guided ran too).
    pub speedup_vs_q_guided: Option<f64>,
    /// This method's KV bytes over Q-guided's.
    pub kv_vs_q_guided: Option<f64>,
    pub rel_error: Option<f64>,
}

/// What to run: the tree's view, its shape and dtype, the methods and the timing.
pub struct TreeBench<'a> {
    pub view: &'a TreeView<'a>,
    pub shape: AttnShape,
    pub dtype: DType,
    pub planner: PlannerConfig,
    /// What `auto` prices its candidates with.
    pub model: DeviceModel,
    /// Whether `auto` times the plans its model cannot tell apart and runs the fastest
    /// ([`crate::timed_auto`]); its planning time then counts the timing.
    pub auto_timed: bool,
    pub iters: usize,
    pub cache: Cache,
}

/// A plan with the host time it took and, for `auto`, the method chosen and its prediction.
pub struct TimedPlan {
    pub plan: Plan,
    pub plan_ms: f64,
    pub chosen: Option<(Method, f64)>,
}

impl TreeBench<'_> {
    /// Plans with `method` (resolving `auto`), timing the planning.
    pub fn plan(&self, method: Method) -> Result<TimedPlan> {
        let t0 = Instant::now();
        let (plan, chosen) = if method == Method::Auto {
            let c = choose(self.view, &self.shape, &self.planner, &self.model)?;
            (c.plan, Some((c.method, c.predicted_us)))
        } else {
            (plan(self.view, method, &self.shape, &self.planner)?, None)
        };
        Ok(TimedPlan {
            plan,
            plan_ms: t0.elapsed().as_secs_f64() * 1e3,
            chosen,
        })
    }

    /// `auto`'s plan settled by the clock over `kv` and `q` ([`choose_timed`]), the timing
    /// counted in the planning time.
    fn plan_timed<B: Backend>(&self, backend: &B, kv: &B::Kv, q: &B::Queries) -> Result<TimedPlan> {
        let t0 = Instant::now();
        let c = choose_timed(
            backend,
            kv,
            q,
            self.view,
            &self.shape,
            &self.planner,
            &self.model,
            TIMED_AUTO_RUNS,
            self.cache,
        )?
        .choice;
        Ok(TimedPlan {
            plan: c.plan,
            plan_ms: t0.elapsed().as_secs_f64() * 1e3,
            chosen: Some((c.method, c.predicted_us)),
        })
    }

    /// Runs every method over the same KV and queries; `oracle` is the f64 reference output
    /// (`queries × q_heads × head_dim`) to check against. Every method is planned, uploaded
    /// and checked first, then all are timed round-robin ([`time_round_robin`]), the whole
    /// step and then stage 1 alone.
    pub fn run<B: Backend>(
        &self,
        backend: &B,
        kv: &B::Kv,
        q: &B::Queries,
        methods: &[Method],
        oracle: Option<&[f64]>,
    ) -> Result<Vec<MethodRun>> {
        let nq = self.view.tree.num_queries();
        let mut planned = Vec::with_capacity(methods.len());
        for &method in methods {
            let planned_one = match (method, self.auto_timed) {
                (Method::Auto, true) => self.plan_timed(backend, kv, q)?,
                _ => self.plan(method)?,
            };
            let dplan = backend.upload_plan(&self.shape, &planned_one.plan)?;
            let mut partials = backend.alloc_partials(&self.shape, &dplan)?;
            let mut states = backend.alloc_states(&self.shape, nq)?;
            backend.poison(&mut partials)?;
            backend.poison(&mut states)?;
            backend.step(kv, q, &dplan, &mut partials, &mut states)?;
            let rel_error = match oracle {
                Some(want) => Some(relative_error(&backend.download(&states)?.o, want)),
                None => None,
            };
            planned.push((planned_one, rel_error, (dplan, partials, states)));
        }
        let mut steps: Vec<_> = planned
            .iter_mut()
            .map(|(_, _, (dplan, partials, states))| {
                move || backend.step(kv, q, dplan, partials, states)
            })
            .collect();
        let times = time_round_robin(backend, self.iters, self.cache, &mut steps)?;
        let mut stage1: Vec<_> = planned
            .iter_mut()
            .map(|(_, _, (dplan, partials, _))| move || backend.run_plan(kv, q, dplan, partials))
            .collect();
        let stage1 = time_round_robin(backend, self.iters, self.cache, &mut stage1)?;
        let mut out: Vec<MethodRun> = methods
            .iter()
            .zip(planned)
            .zip(times.iter().zip(&stage1))
            .map(
                |((&method, (p, rel_error, _)), (times, stage1))| MethodRun {
                    method,
                    chosen: p.chosen.map(|c| c.0),
                    predicted_us: p.chosen.map(|c| c.1),
                    plan_ms: p.plan_ms,
                    io: p.plan.io(&self.shape, self.dtype),
                    median_us: median(times) * 1e3,
                    p10_us: quantile(times, 0.1) * 1e3,
                    p90_us: quantile(times, 0.9) * 1e3,
                    stage1_us: Some(median(stage1) * 1e3),
                    speedup_vs_q_guided: None,
                    kv_vs_q_guided: None,
                    rel_error,
                },
            )
            .collect();
        relate_to_q_guided(&mut out);
        Ok(out)
    }
}

/// Fills the speedup and KV ratio of every run over the Q-guided run, if there is one.
pub fn relate_to_q_guided(runs: &mut [MethodRun]) {
    let Some((time, kv)) = runs
        .iter()
        .find(|r| r.method == Method::QGuided)
        .map(|r| (r.median_us, r.io.kv_bytes))
    else {
        return;
    };
    for r in runs {
        r.speedup_vs_q_guided = Some(time / r.median_us);
        r.kv_vs_q_guided = Some(r.io.kv_bytes as f64 / kv.max(1) as f64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::CpuBackend;
    use crate::strategy::Problem;
    use canopy_core::{workload::random_tree, Shard};

    #[test]
    fn every_method_matches_the_oracle_on_the_cpu() {
        // `auto` by its model and by the clock alike.
        let shape = AttnShape::new(4, 2, 64).unwrap();
        let tree = random_tree(11, 30, 40);
        let problem = Problem::random(tree, shape, DType::F32, 5);
        let shard = Shard::whole(&problem.tree);
        let view = TreeView::new(&problem.tree, &shard);
        let backend = CpuBackend;
        let mut kv = backend
            .alloc_kv(&shape, DType::F32, problem.tree.total_tokens() as usize)
            .unwrap();
        backend
            .write_kv(&mut kv, 0, &problem.data.k, &problem.data.v)
            .unwrap();
        let q = backend.upload_queries(&shape, &problem.data.q).unwrap();
        for auto_timed in [false, true] {
            let bench = TreeBench {
                view: &view,
                shape,
                dtype: DType::F32,
                planner: PlannerConfig::default(),
                model: DeviceModel::default(),
                auto_timed,
                iters: 2,
                cache: Cache::Cold,
            };
            let methods = Method::parse_list("all").unwrap();
            let runs = bench
                .run(&backend, &kv, &q, &methods, Some(&problem.oracle()))
                .unwrap();
            assert_eq!(runs.len(), methods.len());
            for r in &runs {
                assert!(r.rel_error.unwrap() < 1e-5, "{:?}", r);
                assert!(r.speedup_vs_q_guided.unwrap() > 0.0);
            }
            assert!(runs.last().unwrap().chosen.is_some());
        }
    }
}
