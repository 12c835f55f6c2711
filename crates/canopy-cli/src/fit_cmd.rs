//! `canopy fit-model`: fits `auto`'s device model to measured steps.
//!
//! The input is `canopy bench tree --json` output from one GPU: per tree and method, the
//! median step. Each (tree, method) is planned again here exactly as the benchmark planned it,
//! its quantities counted by [`DeviceModel::measure`], and the model's time constants fitted
//! to the measured medians ([`DeviceModel::fit`]). The report says how well the starting and
//! the fitted model rank the measured methods of each tree, which is what `auto` needs from
//! it (its candidates are these methods at these sizes): the regret is the measured time of
//! the model's pick over the best measured time.

use crate::plan_cmd::ShapeArgs;
use crate::table::Table;
use anyhow::{bail, Context, Result};
use canopy_core::{
    plan, DType, DeviceModel, Method, PlannerConfig, Sample, Shard, TreeView, WorkloadSpec,
};
use clap::Args;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

#[derive(Args)]
pub struct FitArgs {
    /// `canopy bench tree --json` outputs (one rank, one GPU kind).
    #[arg(required = true)]
    files: Vec<PathBuf>,
    /// A model (TOML) to start from instead of the built-in defaults.
    #[arg(long)]
    device_model: Option<PathBuf>,
    /// Write the fitted model here (TOML), for `--device-model` of `bench tree` and `plan`.
    #[arg(long)]
    out: Option<PathBuf>,
    #[arg(long)]
    json: bool,
}

/// The fields of `bench tree --json` the fit reads.
#[derive(Deserialize)]
struct TreeRun {
    workload: String,
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    dtype: DType,
    ranks: usize,
    methods: Vec<MethodTime>,
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
}

#[derive(Serialize)]
struct FitOutput {
    samples: usize,
    start_log_error: f64,
    fitted_log_error: f64,
    /// Geometric mean over trees of the measured time of the model's pick over the best.
    start_regret: f64,
    fitted_regret: f64,
    fitted: DeviceModel,
    trees: Vec<TreeFit>,
}

/// The (method, measured µs) whose sample `model` prices lowest.
fn pick(model: &DeviceModel, tree: &[(Method, Sample)]) -> (Method, f64) {
    tree.iter()
        .min_by(|a, b| model.price(&a.1.cost).total_cmp(&model.price(&b.1.cost)))
        .map(|(m, s)| (*m, s.measured_us))
        .expect("a tree with measured methods")
}

/// A measured tree, re-planned as the benchmark planned it.
struct Measured {
    run: TreeRun,
    samples: Vec<(Method, Sample)>,
}

impl Measured {
    fn load(path: &Path, model: &DeviceModel, planner: &PlannerConfig) -> Result<Measured> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let run: TreeRun = serde_json::from_str(&text).with_context(|| {
            format!(
                "{} is not `canopy bench tree --json` output",
                path.display()
            )
        })?;
        if run.ranks != 1 {
            bail!(
                "{}: the model prices one GPU's step; fit it to --ranks 1 runs",
                path.display()
            );
        }
        let mut spec = WorkloadSpec::load(&run.workload)?;
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
}

pub fn run(a: FitArgs) -> Result<()> {
    let start = DeviceModel::load_or_default(a.device_model.as_deref())?;
    // The benchmark's planning: backends split long groups themselves.
    let planner = PlannerConfig::whole_paths();
    let trees = a
        .files
        .iter()
        .map(|p| Measured::load(p, &start, &planner))
        .collect::<Result<Vec<_>>>()?;
    let all: Vec<Sample> = trees
        .iter()
        .flat_map(|t| t.samples.iter().map(|x| x.1))
        .collect();
    if all.is_empty() {
        bail!("no measured methods in the given files");
    }
    let fitted = start.fit(&all);
    let mut fits = Vec::new();
    for t in trees.iter().filter(|t| !t.samples.is_empty()) {
        fits.push(TreeFit {
            workload: t.run.workload.clone(),
            q_heads: t.run.q_heads,
            kv_heads: t.run.kv_heads,
            best: t
                .samples
                .iter()
                .map(|(m, x)| (*m, x.measured_us))
                .min_by(|a, b| a.1.total_cmp(&b.1))
                .expect("non-empty"),
            start_pick: pick(&start, &t.samples),
            fitted_pick: pick(&fitted, &t.samples),
        });
    }
    let out = FitOutput {
        samples: all.len(),
        start_log_error: start.log_error(&all),
        fitted_log_error: fitted.log_error(&all),
        start_regret: canopy_core::stats::geomean(fits.iter().map(|t| t.start_pick.1 / t.best.1)),
        fitted_regret: canopy_core::stats::geomean(fits.iter().map(|t| t.fitted_pick.1 / t.best.1)),
        fitted,
        trees: fits,
    };
    let model_toml = toml::to_string(&out.fitted)?;
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
    println!(
        "{} samples; rms log error {:.3} -> {:.3}; regret (geomean of pick / best) {:.3} -> {:.3}",
        out.samples, out.start_log_error, out.fitted_log_error, out.start_regret, out.fitted_regret
    );
    println!("fitted model:\n{model_toml}");
    Ok(())
}
