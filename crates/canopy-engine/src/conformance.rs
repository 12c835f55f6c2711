//! The conformance suite: one set of cases every backend must pass against the f64 oracle.
//!
//! It lives in the library (not only in `tests/`) so the `canopy selftest` command can run it
//! on a GPU machine from the release binary, where there is no cargo. Every case draws fresh
//! random data, backends start from poisoned (NaN) outputs, and each case checks every query.

use crate::backend::Backend;
use crate::strategy::{run_threads, Problem, RunConfig, Strategy};
use crate::Result;
use canopy_core::{
    random_tree, relative_error, AttnShape, DType, KvTree, Method, PlannerConfig, TreeBuilder,
    WorkloadSpec,
};
use std::time::Duration;

/// Tolerance on `‖out − oracle‖ / ‖oracle‖` for outputs from `dtype` storage. Inputs are drawn
/// representable in the dtype, so fp32 accumulation alone should land far below these; the
/// 16-bit bounds leave room for GPU kernels that round probabilities for tensor cores.
pub fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-5,
        DType::F16 => 2e-3,
        DType::Bf16 => 1e-2,
    }
}

/// One checked case.
#[derive(Debug, Clone)]
pub struct CaseResult {
    pub name: String,
    pub rel_error: f64,
    pub tolerance: f64,
    pub passed: bool,
}

/// The suite's trees: random ones of every kind plus small versions of the named workloads.
pub fn suite_trees(seed: u64, random_cases: usize) -> Vec<(String, KvTree)> {
    let mut trees: Vec<(String, KvTree)> = (0..random_cases as u64)
        .map(|i| {
            (
                format!("random-{i}"),
                random_tree(seed ^ (i * 0x9E37), 24, 48),
            )
        })
        .collect();
    // The shapes the issue names beside the random ones: one node, and a fan of 1,100 leaves of
    // 1-3 tokens (more queries than a mask word or a CTA's rows hold).
    let mut single = TreeBuilder::new();
    let root = single.add_root(37);
    single.add_query(root).expect("node exists");
    trees.push(("single-node".into(), single.build().expect("valid")));
    let mut wide = TreeBuilder::new();
    let root = wide.add_root(40);
    for i in 0..1100u32 {
        let leaf = wide.add_child(root, i % 3 + 1).expect("parent exists");
        wide.add_query(leaf).expect("node exists");
    }
    trees.push(("fan-1100".into(), wide.build().expect("valid")));
    // Small versions of the named workloads: FastTree's smallest tree as is, the DeFT ones with
    // a 300-token prompt.
    let named = [
        ("fasttree-0", None),
        ("few-shot-b20", Some(300)),
        ("tot-set", Some(300)),
        ("spec-t32", Some(300)),
    ];
    for (name, prompt_len) in named {
        let overrides = canopy_core::Overrides {
            prompt_len,
            ..Default::default()
        };
        let spec = WorkloadSpec::load(name).and_then(|s| s.with_overrides(overrides));
        let tree = spec
            .and_then(|s| s.build_tree())
            .expect("built-in workload builds");
        trees.push((name.to_string(), tree));
    }
    trees
}

/// Runs every method × strategy × dtype × shape on `ranks` ranks of `make`'s backend.
pub fn run_suite<B, F>(
    make: F,
    ranks: &[usize],
    seed: u64,
    random_cases: usize,
) -> Result<Vec<CaseResult>>
where
    B: Backend,
    F: Fn(usize) -> Result<B> + Sync,
{
    let shapes = [
        AttnShape::new(4, 4, 64)?,
        AttnShape::new(8, 2, 128)?,
        AttnShape::new(4, 1, 256)?,
    ];
    let mut out = Vec::new();
    for (t, (tree_name, tree)) in suite_trees(seed, random_cases).into_iter().enumerate() {
        let shape = shapes[t % shapes.len()];
        let dtype = DType::ALL[t % 3];
        let problem = Problem::random(tree, shape, dtype, seed.wrapping_add(t as u64));
        let oracle = problem.oracle();
        for &p in ranks {
            for method in Method::ALL.into_iter().chain([Method::Auto]) {
                for strategy in Strategy::every() {
                    let cfg = RunConfig {
                        ranks: p,
                        strategy,
                        method,
                        planner: PlannerConfig::default(),
                        warmup: 0,
                        iters: 1,
                        timeout: Duration::from_secs(60),
                        poison: true,
                        // Two virtual nodes wherever they divide the world evenly.
                        virtual_nodes: (p % 2 == 0).then_some(2),
                    };
                    let report = run_threads(&problem, &cfg, Some(&oracle), &make)?;
                    let err = report
                        .rel_error
                        .unwrap_or(f64::NAN)
                        .max(relative_error(&report.output.o, &oracle));
                    let tol = tolerance(dtype);
                    out.push(CaseResult {
                        name: format!(
                            "{tree_name} {dtype} h{}/{}x{} p={p} {method} {}",
                            shape.q_heads,
                            shape.kv_heads,
                            shape.head_dim,
                            strategy.name()
                        ),
                        rel_error: err,
                        tolerance: tol,
                        passed: err < tol && report.output.lse.iter().all(|x| !x.is_nan()),
                    });
                }
            }
        }
    }
    Ok(out)
}
