//! `canopy fit-model`: fits `auto`'s device model to measured steps.
//!
//! The input is `canopy bench tree --json` output from one GPU, single trees or `--sweep`
//! runs: per tree and method, the median step. Each (tree, method) is planned again here
//! exactly as the benchmark planned it (a sweep's trees from their draw names), its
//! quantities counted by [`DeviceModel::measure`], and the model's time constants fitted to
//! the measured medians ([`DeviceModel::fit`]). The report says how well the starting and
//! the fitted model rank the measured methods of each tree, which is what `auto` needs from
//! it (its candidates are these methods at these sizes): the regret is the measured time of
//! the model's pick over the best measured time, beside the share of trees within 1.05x of
//! the best, the worst, the picks more than 3% slower than `q-guided` and the geomean speedup
//! over it (issue 25's measures). Picks are `auto`'s ([`DeviceModel::pick`]), and the fitted
//! model's `q_guided_margin` is its median error against q-guided on the fitted trees
//! ([`DeviceModel::q_guided_margin`]). `--holdout` runs are not fitted to: the fitted model's
//! scores on them say how it does on trees it was not tuned on. `--objective picks` goes on
//! from the log-error fit to minimise the regret itself. To score a model without fitting it,
//! give it as `--device-model` and read its "start" rows.

use crate::plan_cmd::ShapeArgs;
use crate::table::Table;
use anyhow::{bail, Context, Result};
use canopy_core::random_trees;
use canopy_core::stats::geomean;
use canopy_core::{
    plan, AttnShape, DType, DeviceModel, Method, PlanCost, PlannerConfig, Sample, Shard, TreeView,
    WorkloadSpec,
};
use clap::Args;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

#[derive(Args)]
pub struct FitArgs {
    /// `canopy bench tree --json` outputs, single trees or sweeps (one rank, one GPU kind).
    #[arg(required = true)]
    files: Vec<PathBuf>,
    /// Runs to judge the fitted model on, not fitted to (e.g. a sweep of another seed); a
    /// tree and head configuration in both sets is an error.
    #[arg(long, num_args = 1.., value_name = "FILES")]
    holdout: Vec<PathBuf>,
    /// A model (TOML) to start from instead of the built-in defaults.
    #[arg(long)]
    device_model: Option<PathBuf>,
    /// What the fit minimises.
    #[arg(long, value_enum, default_value = "log-error")]
    objective: Objective,
    /// Write the fitted model here (TOML), for `--device-model` of `bench tree` and `plan`.
    #[arg(long)]
    out: Option<PathBuf>,
    #[arg(long)]
    json: bool,
}

/// What the fit minimises.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Objective {
    /// The rms log error of the predicted steps: the model prices every plan well.
    LogError,
    /// The regret of the model's picks (geomean of the pick's measured time over the best's),
    /// starting from the log-error fit: what `auto` needs, which is the plans' order.
    Picks,
}

/// The log error's weight beside ln(regret) in the picks objective: regret is flat between
/// the points where a pick changes, and the error keeps the descent moving across them.
const PICKS_LOG_ERROR_WEIGHT: f64 = 0.05;

/// The fields of `bench tree --json` the fit reads.
#[derive(Deserialize)]
struct TreeRun {
    workload: String,
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    dtype: DType,
    /// Absent in a sweep's rows, which are one rank.
    #[serde(default = "one_rank")]
    ranks: usize,
    methods: Vec<MethodTime>,
}

fn one_rank() -> usize {
    1
}

/// `bench tree --sweep --json`: the fields the fit reads.
#[derive(Deserialize)]
struct SweepRun {
    rows: Vec<TreeRun>,
}

#[derive(Deserialize)]
struct MethodTime {
    method: Method,
    median_us: f64,
}

/// One tree's measured methods and what each model picks among them.
#[derive(Serialize)]
struct TreeFit {
    workload: String,
    q_heads: usize,
    kv_heads: usize,
    best: (Method, f64),
    start_pick: (Method, f64),
    fitted_pick: (Method, f64),
    methods: Vec<MethodFit>,
}

/// One method's measured step, the quantities the model prices it by, and both models' prices.
#[derive(Serialize)]
struct MethodFit {
    method: Method,
    measured_us: f64,
    start_us: f64,
    fitted_us: f64,
    cost: PlanCost,
}

/// How one model does on a set of trees: what `auto` would gain and lose with it.
#[derive(Serialize)]
struct Picks {
    log_error: f64,
    /// Geometric mean over trees of the measured time of the model's pick over the best.
    regret: f64,
    /// The largest pick / best, and the share of trees within 1.05x.
    worst_regret: f64,
    within_1_05: f64,
    /// Trees where the pick measured more than 3% slower than `q-guided`.
    slower_than_q_guided: usize,
    /// Geometric mean of `q-guided`'s measured time over the pick's.
    speedup_over_q_guided: f64,
    /// Plans timed a tree (the clock's shortlist; 0 for the model's own pick).
    timed_per_tree: f64,
}

/// How `auto` settles on a plan with a model: the model's pick, or the fastest measured of
/// the model's shortlist (`bench tree --auto-timed`; here the sweep's medians stand in for
/// its timing).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Settle {
    Model,
    Clock,
}

/// How the starting and the fitted model do on one set of trees.
#[derive(Serialize)]
struct Score {
    samples: usize,
    trees: usize,
    start: Picks,
    fitted: Picks,
    /// Each model's shortlist settled by the measured times.
    start_clock: Picks,
    fitted_clock: Picks,
}

#[derive(Serialize)]
struct FitOutput {
    #[serde(flatten)]
    fit: Score,
    /// The same on the `--holdout` runs.
    holdout: Option<Score>,
    /// The fitted model, as `--out` writes it.
    model: DeviceModel,
    trees: Vec<TreeFit>,
}

/// The (method, measured µs) `auto` runs with `model`, settled as `settle` says
/// ([`DeviceModel::pick`], or the fastest measured of [`DeviceModel::shortlist`]), and the
/// plans it timed.
fn pick(model: &DeviceModel, tree: &[(Method, Sample)], settle: Settle) -> ((Method, f64), usize) {
    let predicted: Vec<(Method, f64)> = tree
        .iter()
        .map(|(m, s)| (*m, model.price(&s.cost)))
        .collect();
    let (i, timed) = match settle {
        Settle::Model => (model.pick(&predicted), 0),
        Settle::Clock => {
            let shortlist = model.shortlist(&predicted);
            let fastest = shortlist
                .iter()
                .copied()
                .min_by(|&a, &b| tree[a].1.measured_us.total_cmp(&tree[b].1.measured_us));
            (
                fastest,
                if shortlist.len() > 1 {
                    shortlist.len()
                } else {
                    0
                },
            )
        }
    };
    let i = i.expect("a tree with measured methods");
    ((tree[i].0, tree[i].1.measured_us), timed)
}

/// The geometric mean over `trees` of the measured time of `model`'s pick over the best.
fn regret(model: &DeviceModel, trees: &[Measured]) -> f64 {
    geomean(trees.iter().filter(|t| !t.samples.is_empty()).map(|t| {
        let best = t
            .samples
            .iter()
            .map(|x| x.1.measured_us)
            .fold(f64::INFINITY, f64::min);
        pick(model, &t.samples, Settle::Model).0 .1 / best
    }))
}

/// A measured tree, re-planned as the benchmark planned it.
struct Measured {
    run: TreeRun,
    samples: Vec<(Method, Sample)>,
}

impl Measured {
    /// Every tree of a `bench tree --json` file, one or a sweep's rows.
    fn load_file(path: &Path, model: &DeviceModel, planner: &PlannerConfig) -> Result<Vec<Self>> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let not_ours = || {
            format!(
                "{} is not `canopy bench tree --json` output",
                path.display()
            )
        };
        let value: serde_json::Value = serde_json::from_str(&text).with_context(not_ours)?;
        let runs = if value.get("rows").is_some() {
            serde_json::from_value::<SweepRun>(value)
                .with_context(not_ours)?
                .rows
        } else {
            vec![serde_json::from_value::<TreeRun>(value).with_context(not_ours)?]
        };
        runs.into_iter()
            .map(|run| Self::new(run, model, planner).with_context(|| path.display().to_string()))
            .collect()
    }

    fn new(run: TreeRun, model: &DeviceModel, planner: &PlannerConfig) -> Result<Measured> {
        if run.ranks != 1 {
            bail!("the model prices one GPU's step; fit it to --ranks 1 runs");
        }
        // A sweep's trees are named by their draw; the others are workloads.
        let mut spec = match random_trees::from_name(&run.workload) {
            Some(d) => WorkloadSpec {
                name: d.name,
                description: String::new(),
                shape: AttnShape::new(run.q_heads, run.kv_heads, run.head_dim)?,
                dtype: run.dtype,
                tree: d.spec,
            },
            None => WorkloadSpec::load(&run.workload)?,
        };
        ShapeArgs {
            heads: Some(run.q_heads),
            kv_heads: Some(run.kv_heads),
            head_dim: Some(run.head_dim),
            dtype: Some(run.dtype),
        }
        .apply(&mut spec)?;
        let tree = spec.build_tree()?;
        let shard = Shard::whole(&tree);
        let view = TreeView::new(&tree, &shard);
        let mut samples = Vec::new();
        for m in run.methods.iter().filter(|m| m.method != Method::Auto) {
            let p = plan(&view, m.method, &spec.shape, planner)?;
            let cost = model.measure(&p, &spec.shape);
            let measured_us = m.median_us;
            samples.push((m.method, Sample { cost, measured_us }));
        }
        Ok(Measured { run, samples })
    }

    /// The tree and head configuration, which a holdout must not share with the fit.
    fn key(&self) -> (String, usize, usize, usize) {
        let r = &self.run;
        (r.workload.clone(), r.q_heads, r.kv_heads, r.head_dim)
    }
}

fn load_all(
    files: &[PathBuf],
    model: &DeviceModel,
    planner: &PlannerConfig,
) -> Result<Vec<Measured>> {
    let mut trees = Vec::new();
    for p in files {
        trees.extend(Measured::load_file(p, model, planner)?);
    }
    Ok(trees)
}

/// How `model`'s picks, settled as `settle` says, do on `trees`.
fn picks(model: &DeviceModel, trees: &[Measured], all: &[Sample], settle: Settle) -> Picks {
    let mut ratios = Vec::new();
    let mut over_q = Vec::new();
    let mut timed = 0;
    for t in trees.iter().filter(|t| !t.samples.is_empty()) {
        let measured = |m: Method| t.samples.iter().find(|x| x.0 == m).map(|x| x.1.measured_us);
        let best = t
            .samples
            .iter()
            .map(|x| x.1.measured_us)
            .fold(f64::INFINITY, f64::min);
        let ((_, pick), plans) = pick(model, &t.samples, settle);
        timed += plans;
        ratios.push(pick / best);
        if let Some(q) = measured(Method::QGuided) {
            over_q.push(pick / q);
        }
    }
    Picks {
        log_error: model.log_error(all),
        regret: geomean(ratios.iter().copied()),
        worst_regret: ratios.iter().copied().fold(1.0, f64::max),
        within_1_05: ratios.iter().filter(|&&r| r <= 1.05).count() as f64
            / ratios.len().max(1) as f64,
        slower_than_q_guided: over_q.iter().filter(|&&r| r > 1.03).count(),
        speedup_over_q_guided: 1.0 / geomean(over_q.iter().copied()),
        timed_per_tree: timed as f64 / ratios.len().max(1) as f64,
    }
}

/// Each tree's best measured method and both models' picks, and the scores over them.
fn score(start: &DeviceModel, fitted: &DeviceModel, trees: &[Measured]) -> (Score, Vec<TreeFit>) {
    let all: Vec<Sample> = trees
        .iter()
        .flat_map(|t| t.samples.iter().map(|x| x.1))
        .collect();
    let fits: Vec<TreeFit> = trees
        .iter()
        .filter(|t| !t.samples.is_empty())
        .map(|t| TreeFit {
            workload: t.run.workload.clone(),
            q_heads: t.run.q_heads,
            kv_heads: t.run.kv_heads,
            best: t
                .samples
                .iter()
                .map(|(m, x)| (*m, x.measured_us))
                .min_by(|a, b| a.1.total_cmp(&b.1))
                .expect("non-empty"),
            start_pick: pick(start, &t.samples, Settle::Model).0,
            fitted_pick: pick(fitted, &t.samples, Settle::Model).0,
            methods: t
                .samples
                .iter()
                .map(|(m, x)| MethodFit {
                    method: *m,
                    measured_us: x.measured_us,
                    start_us: start.price(&x.cost),
                    fitted_us: fitted.price(&x.cost),
                    cost: x.cost,
                })
                .collect(),
        })
        .collect();
    let score = Score {
        samples: all.len(),
        trees: fits.len(),
        start: picks(start, trees, &all, Settle::Model),
        fitted: picks(fitted, trees, &all, Settle::Model),
        start_clock: picks(start, trees, &all, Settle::Clock),
        fitted_clock: picks(fitted, trees, &all, Settle::Clock),
    };
    (score, fits)
}

pub fn run(a: FitArgs) -> Result<()> {
    let start = DeviceModel::load_or_default(a.device_model.as_deref())?;
    // The benchmark's planning: backends split long groups themselves.
    let planner = PlannerConfig::whole_paths();
    let trees = load_all(&a.files, &start, &planner)?;
    let all: Vec<Sample> = trees
        .iter()
        .flat_map(|t| t.samples.iter().map(|x| x.1))
        .collect();
    if all.is_empty() {
        bail!("no measured methods in the given files");
    }
    let held = load_all(&a.holdout, &start, &planner)?;
    let fitted_keys: std::collections::HashSet<_> = trees.iter().map(Measured::key).collect();
    if let Some(t) = held.iter().find(|t| fitted_keys.contains(&t.key())) {
        bail!(
            "--holdout: {} at {}/{}x{} is in the fitted runs too; a holdout must be disjoint",
            t.run.workload,
            t.run.q_heads,
            t.run.kv_heads,
            t.run.head_dim
        );
    }
    let fitted = start.fit(&all);
    let fitted = match a.objective {
        Objective::LogError => fitted,
        Objective::Picks => {
            fitted.fit_by(|m| regret(m, &trees).ln() + PICKS_LOG_ERROR_WEIGHT * m.log_error(&all))
        }
    };
    // The guard's margin is the fitted model's own error against q-guided on these trees.
    let fitted = DeviceModel {
        q_guided_margin: fitted.q_guided_margin(trees.iter().map(|t| t.samples.as_slice())),
        ..fitted
    };
    let (fit, fits) = score(&start, &fitted, &trees);
    let holdout = (!held.is_empty()).then(|| score(&start, &fitted, &held).0);
    let out = FitOutput {
        fit,
        holdout,
        model: fitted,
        trees: fits,
    };
    let model_toml = toml::to_string(&out.model)?;
    if let Some(p) = &a.out {
        std::fs::write(p, &model_toml).with_context(|| format!("writing {}", p.display()))?;
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    let mut t = Table::new(&["tree", "q/kv", "best (µs)", "start's pick", "fitted's pick"]);
    let cell = |(m, us): (Method, f64), best: f64| format!("{m} {us:.1} ({:.2}x)", us / best);
    for f in &out.trees {
        t.row(vec![
            f.workload.clone(),
            format!("{}/{}", f.q_heads, f.kv_heads),
            format!("{} {:.1}", f.best.0, f.best.1),
            cell(f.start_pick, f.best.1),
            cell(f.fitted_pick, f.best.1),
        ]);
    }
    println!("{}", t.render());
    let mut t = Table::new(&[
        "set",
        "model",
        "trees",
        "rms log error",
        "regret",
        "worst",
        "within 1.05x",
        "> 1.03x q-guided",
        "over q-guided",
        "timed a tree",
    ]);
    let sets = [("fit", Some(&out.fit)), ("holdout", out.holdout.as_ref())];
    for (set, s) in sets.into_iter().filter_map(|(n, s)| Some((n, s?))) {
        for (model, p) in [
            ("start", &s.start),
            ("fitted", &s.fitted),
            ("start, clock", &s.start_clock),
            ("fitted, clock", &s.fitted_clock),
        ] {
            t.row(vec![
                set.to_string(),
                model.to_string(),
                s.trees.to_string(),
                format!("{:.3}", p.log_error),
                format!("{:.3}", p.regret),
                format!("{:.2}x", p.worst_regret),
                format!("{:.1}%", 100.0 * p.within_1_05),
                p.slower_than_q_guided.to_string(),
                format!("{:.2}x", p.speedup_over_q_guided),
                format!("{:.2}", p.timed_per_tree),
            ]);
        }
    }
    println!("{}", t.render());
    println!("fitted model:\n{model_toml}");
    Ok(())
}
