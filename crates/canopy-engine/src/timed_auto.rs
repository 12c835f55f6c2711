//! `auto` settled by the clock: of the plans `auto`'s device model cannot tell apart
//! ([`DeviceModel::shortlist`]), the one that runs fastest on the backend, timed over the KV
//! and queries it is chosen for.
//!
//! The model prices a plan within about 10% (its rms log error on a draw it was not fitted
//! to, `docs/BENCHMARKS.md`), so where two plans are predicted within that of each other its
//! pick is a coin toss: on random trees it misses the fastest method by more than 5% on about
//! one tree in six. `q-guided`, the baseline `auto` must never lose to, is timed beside them.
//! Each plan on the shortlist costs an upload and a few runs, which a decode that reuses its
//! plan for many steps repays.

use crate::backend::{time_round_robin, Backend, Cache};
use crate::Result;
use canopy_core::stats::median;
use canopy_core::{
    auto_choices, predictions, AttnShape, AutoChoice, DeviceModel, Method, PlannerConfig, TreeView,
};

/// How much faster than `q-guided` another plan must time to be chosen over it: the
/// baseline's tolerance in the goal `auto` is held to (never more than 3% slower than
/// `q-guided`), which two timings of one plan of tens of microseconds can differ by.
pub const SWITCH_GAIN: f64 = 0.03;

/// What [`choose_timed`] chose, and the median microseconds of every plan it timed (none
/// where the shortlist held one plan).
pub struct TimedChoice {
    pub choice: AutoChoice,
    pub timed: Vec<(Method, f64)>,
}

/// Plans `view` with every candidate of `auto`, times every plan on the model's shortlist
/// (`runs` times each over `kv` and `q`, round-robin, with the backend's clock and L2 as
/// `cache` says), and keeps the fastest, or `q-guided` where it is within [`SWITCH_GAIN`] of
/// the fastest; a shortlist of one is kept untimed.
#[allow(clippy::too_many_arguments)]
pub fn choose_timed<B: Backend>(
    backend: &B,
    kv: &B::Kv,
    q: &B::Queries,
    view: &TreeView,
    shape: &AttnShape,
    base: &PlannerConfig,
    model: &DeviceModel,
    runs: usize,
    cache: Cache,
) -> Result<TimedChoice> {
    let mut choices = auto_choices(view, shape, base, model)?;
    let shortlist = model.shortlist(&predictions(&choices));
    if let [only] = shortlist[..] {
        return Ok(TimedChoice {
            choice: choices.swap_remove(only),
            timed: Vec::new(),
        });
    }
    let queries = view.tree.num_queries();
    let mut runners = shortlist
        .iter()
        .map(|&i| {
            let plan = backend.upload_plan(shape, &choices[i].plan)?;
            let partials = backend.alloc_partials(shape, &plan)?;
            let states = backend.alloc_states(shape, queries)?;
            Ok((plan, partials, states))
        })
        .collect::<Result<Vec<_>>>()?;
    let mut steps: Vec<_> = runners
        .iter_mut()
        .map(|(plan, partials, states)| move || backend.step(kv, q, plan, partials, states))
        .collect();
    let times = time_round_robin(backend, runs, cache, &mut steps)?;
    let timed: Vec<(usize, f64)> = shortlist
        .iter()
        .zip(&times)
        .map(|(&i, t)| (i, median(t) * 1e3))
        .collect();
    let fastest = timed
        .iter()
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .copied()
        .expect("a shortlist of two or more");
    // `q-guided` keeps its place unless another plan beats it by more than the noise band.
    let q_guided = timed
        .iter()
        .find(|t| choices[t.0].method == Method::QGuided)
        .filter(|t| t.1 <= fastest.1 * (1.0 + SWITCH_GAIN));
    let fastest = q_guided.map_or(fastest.0, |t| t.0);
    let timed = timed
        .into_iter()
        .map(|(i, us)| (choices[i].method, us))
        .collect();
    Ok(TimedChoice {
        choice: choices.swap_remove(fastest),
        timed,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CpuBackend, Problem};
    use canopy_core::{workload::random_tree, DType, Shard};

    /// Where the model is sure, nothing is timed and its pick stands; where it is not, every
    /// plan on its shortlist is timed and the choice is the fastest of them, `q-guided`
    /// keeping its place within the switch band.
    #[test]
    fn the_clock_settles_what_the_model_cannot() {
        let shape = AttnShape::new(8, 2, 64).unwrap();
        let problem = Problem::random(random_tree(11, 40, 60), shape, DType::F32, 5);
        let shard = Shard::whole(&problem.tree);
        let view = TreeView::new(&problem.tree, &shard);
        let backend = CpuBackend;
        let tokens = problem.tree.total_tokens() as usize;
        let mut kv = backend.alloc_kv(&shape, DType::F32, tokens).unwrap();
        backend
            .write_kv(&mut kv, 0, &problem.data.k, &problem.data.v)
            .unwrap();
        let q = backend.upload_queries(&shape, &problem.data.q).unwrap();
        let base = PlannerConfig::default();

        let with_margin = |margin| {
            let model = DeviceModel {
                q_guided_margin: margin,
                ..DeviceModel::default()
            };
            let t = choose_timed(
                &backend,
                &kv,
                &q,
                &view,
                &shape,
                &base,
                &model,
                2,
                Cache::Warm,
            );
            (model, t.unwrap())
        };

        // A margin of 0: the model's pick and q-guided are timed (ties aside, nothing else),
        // and the faster of them runs.
        let (sure, t) = with_margin(0.0);
        let pick = canopy_core::choose(&view, &shape, &base, &sure).unwrap();
        let tied = predictions(&auto_choices(&view, &shape, &base, &sure).unwrap())
            .iter()
            .filter(|p| p.1 == pick.predicted_us)
            .count();
        if tied == 1 && pick.method != Method::QGuided {
            let timed: Vec<Method> = t.timed.iter().map(|x| x.0).collect();
            assert!(timed.contains(&pick.method) && timed.contains(&Method::QGuided));
            assert_eq!(timed.len(), 2, "{timed:?}");
        }
        assert_eq!(t.choice.method, settled(&t.timed).unwrap_or(pick.method));

        // A margin wide enough that the model can tell no candidate apart: all are timed.
        let (_, t) = with_margin(100.0);
        assert_eq!(t.timed.len(), canopy_core::auto_candidates(&base).len());
        assert_eq!(Some(t.choice.method), settled(&t.timed));
        assert!(t.timed.iter().all(|x| x.1 > 0.0));
    }

    /// What the clock settles on: the fastest plan timed, or `q-guided` within
    /// [`SWITCH_GAIN`] of it (`None`: nothing was timed).
    fn settled(timed: &[(Method, f64)]) -> Option<Method> {
        let fastest = timed.iter().min_by(|a, b| a.1.total_cmp(&b.1))?;
        Some(match timed.iter().find(|t| t.0 == Method::QGuided) {
            Some(q) if q.1 <= fastest.1 * (1.0 + SWITCH_GAIN) => Method::QGuided,
            _ => fastest.0,
        })
    }
}
