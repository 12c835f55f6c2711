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

use crate::backend::{Backend, Cache};
use crate::Result;
use canopy_core::stats::median;
use canopy_core::{
    auto_choices, predictions, AttnShape, AutoChoice, DeviceModel, Method, PlannerConfig, TreeView,
};

/// What [`choose_timed`] chose, and the median microseconds of every plan it timed (none
/// where the shortlist held one plan).
pub struct TimedChoice {
    pub choice: AutoChoice,
    pub timed: Vec<(Method, f64)>,
}

/// Plans `view` with every candidate of `auto`, times every plan on the model's shortlist
/// (`runs` times each over `kv` and `q`, with the backend's clock and L2 as `cache` says), and
/// keeps the fastest; a shortlist of one is kept untimed.
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
    let mut timed = Vec::with_capacity(shortlist.len());
    for &i in &shortlist {
        let plan = backend.upload_plan(shape, &choices[i].plan)?;
        let mut partials = backend.alloc_partials(shape, &plan)?;
        let mut states = backend.alloc_states(shape, queries)?;
        let times = backend.time_steps(runs, cache, &mut || {
            backend.step(kv, q, &plan, &mut partials, &mut states)
        })?;
        timed.push((i, median(&times) * 1e3));
    }
    let fastest = timed
        .iter()
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .map(|t| t.0)
        .expect("a shortlist of two or more");
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
    /// plan on its shortlist is timed and the choice is the fastest of them.
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
        let fastest = t.timed.iter().min_by(|a, b| a.1.total_cmp(&b.1));
        assert_eq!(t.choice.method, fastest.map_or(pick.method, |f| f.0));

        // A margin wide enough that the model can tell no candidate apart: all are timed.
        let (_, t) = with_margin(100.0);
        assert_eq!(t.timed.len(), canopy_core::auto_candidates(&base).len());
        let fastest = t.timed.iter().min_by(|a, b| a.1.total_cmp(&b.1)).unwrap();
        assert_eq!(t.choice.method, fastest.0);
        assert!(t.timed.iter().all(|x| x.1 > 0.0));
    }
}
