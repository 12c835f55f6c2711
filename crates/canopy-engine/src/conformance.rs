//! The conformance suite: one set of cases every backend must pass against the f64 oracle.
//!
//! It lives in the library (not only in `tests/`) so the `canopy selftest` command can run it
//! on a GPU machine from the release binary, where there is no cargo. Every case draws fresh
//! random data, backends start from poisoned (NaN) outputs, and each case checks every query.

use crate::backend::Backend;
use crate::strategy::{run_threads, Problem, RunConfig, Strategy};
use crate::Result;
use canopy_core::{
    plan, random_tree, relative_error, AttnShape, DType, KvTree, Method, PlannerConfig, Shard,
    Tail, TreeBuilder, TreeView, WorkloadSpec,
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

/// The suite's trees: random ones of every kind plus small versions of the named workloads,
/// each with the shape it must run at, if any (the others take the suite's shapes in turn).
pub fn suite_trees(seed: u64, random_cases: usize) -> Vec<(String, KvTree, Option<AttnShape>)> {
    let mut trees: Vec<(String, KvTree, Option<AttnShape>)> = (0..random_cases as u64)
        .map(|i| {
            (
                format!("random-{i}"),
                random_tree(seed ^ (i * 0x9E37), 24, 48),
                None,
            )
        })
        .collect();
    // The shapes the issue names beside the random ones: one node, and a fan of 1,100 leaves of
    // 1-3 tokens (more queries than a mask word or a CTA's rows hold).
    let mut single = TreeBuilder::new();
    let root = single.add_root(37);
    single.add_query(root).expect("node exists");
    trees.push(("single-node".into(), single.build().expect("valid"), None));
    trees.push((
        "fan-1100".into(),
        fan(40, (0..1100).map(|i| i % 3 + 1)),
        None,
    ));
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
        trees.push((name.to_string(), tree, None));
    }
    // A prompt shared by 72 sequences at GQA 4 with heads of 128: its queries split into blocks
    // of 64 rows over the same KV (the tensor-core kernel's many-row CTAs, on the warpgroup MMA
    // on Hopper), and its 300 tokens end inside a 64-token tile.
    let gqa4 = AttnShape::new(8, 2, 128).expect("valid shape");
    trees.push((
        "prompt-72".into(),
        fan(300, (0..72).map(|i| i % 4 + 1)),
        Some(gqa4),
    ));
    // Groups that do not divide a CTA's 64 rows: 3 heads of 128 over KV heads in fours
    // (Llama-3.2-3B's 24/8, whose leaves' groups of 3 rows run one warp per KV head on
    // tensor cores), 7 of 128 and 5 of 64, so that a block of queries ends short of its rows
    // and a group's heads never straddle two blocks.
    for (q_heads, kv_heads, head_dim, leaves) in
        [(12, 4, 128, 45), (7, 1, 128, 23), (10, 2, 64, 30)]
    {
        let shape = AttnShape::new(q_heads, kv_heads, head_dim).expect("valid shape");
        trees.push((
            format!("prompt-{leaves}-gqa{}", q_heads / kv_heads),
            fan(200, (0..leaves).map(|i| i % 5 + 1)),
            Some(shape),
        ));
    }
    trees
}

/// A root of `root_len` tokens with one leaf per length of `leaf_lens`, a query on each leaf.
fn fan(root_len: u32, leaf_lens: impl Iterator<Item = u32>) -> KvTree {
    let mut b = TreeBuilder::new();
    let root = b.add_root(root_len);
    for len in leaf_lens {
        let leaf = b.add_child(root, len).expect("parent exists");
        b.add_query(leaf).expect("node exists");
    }
    b.build().expect("valid")
}

/// Runs every method × strategy × dtype × shape on `ranks` ranks of `make`'s backend.
pub fn run_suite<B, F>(
    make: F,
    ranks: &[usize],
    seed: u64,
    random_cases: usize,
) -> Result<Vec<CaseResult>>
where
    B: crate::merge::MergeOps,
    F: Fn(usize) -> Result<B> + Sync,
{
    let shapes = [
        AttnShape::new(4, 4, 64)?,
        AttnShape::new(8, 2, 128)?,
        AttnShape::new(4, 1, 256)?,
    ];
    let mut out = Vec::new();
    for (t, (tree_name, tree, named_shape)) in
        suite_trees(seed, random_cases).into_iter().enumerate()
    {
        let shape = named_shape.unwrap_or(shapes[t % shapes.len()]);
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
                        cache: crate::Cache::Warm,
                        timeout: Duration::from_secs(60),
                        poison: true,
                        // Two virtual nodes wherever they divide the world evenly.
                        virtual_nodes: (p % 2 == 0).then_some(2),
                        stall_rank: None,
                    };
                    let report = run_threads(&problem, &cfg, Some(&oracle), &make)?;
                    let output = report
                        .output
                        .clone()
                        .expect("a thread run keeps rank 0's output");
                    let err = report
                        .rel_error
                        .unwrap_or(f64::NAN)
                        .max(relative_error(&output.o, &oracle));
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
                        passed: err < tol && output.lse.iter().all(|x| !x.is_nan()),
                    });
                }
            }
        }
    }
    let backend = make(0)?;
    out.extend(growth_cases(&backend, seed)?);
    out.extend(replan_cases(&backend, seed)?);
    Ok(out)
}

/// Plans extended in place ([`Backend::extend_plan`]): a tree laid out on 16-token pages is
/// planned and uploaded, its leaves then grow inside their pages, and the uploaded plan is
/// extended instead of replanned; the step must match the oracle on the grown tree. Every
/// method (DeFT-Flatten's masks grow too) and dtype, on a small fork and on a fan wide enough
/// for the many-row tensor-core path.
pub fn growth_cases<B: Backend>(backend: &B, seed: u64) -> Result<Vec<CaseResult>> {
    let build = |leaves: &[u32]| {
        let mut b = TreeBuilder::new().with_alignment(16);
        let root = b.add_root(40);
        for &len in leaves {
            let leaf = b.add_child(root, len).expect("parent exists");
            b.add_query(leaf).expect("node exists");
        }
        b.build().expect("valid")
    };
    let fork: Vec<u32> = vec![3, 9, 1, 12, 5];
    let fan: Vec<u32> = (0..40).map(|i| 1 + i % 7).collect();
    let shapes = [AttnShape::new(8, 2, 128)?, AttnShape::new(4, 4, 64)?];
    let mut out = Vec::new();
    for (c, (name, leaves)) in [("fork", fork), ("fan-40", fan)].into_iter().enumerate() {
        let before = build(&leaves);
        let grown: Vec<u32> = leaves.iter().map(|&l| l + 1 + l % 3).collect();
        let after = build(&grown);
        let tails: Vec<Tail> = before
            .nodes()
            .iter()
            .zip(after.nodes())
            .filter(|(b, a)| b.kv.end != a.kv.end)
            .map(|(b, a)| Tail {
                end: b.kv.end,
                new_end: a.kv.end,
            })
            .collect();
        for (d, dtype) in DType::ALL.into_iter().enumerate() {
            let shape = shapes[(c + d) % shapes.len()];
            let case_seed = seed ^ (0x6A09 + (c * 3 + d) as u64);
            let problem = Problem::random(after.clone(), shape, dtype, case_seed);
            let oracle = problem.oracle();
            let mut kv = backend.alloc_kv(&shape, dtype, after.total_tokens() as usize)?;
            backend.write_kv(&mut kv, 0, &problem.data.k, &problem.data.v)?;
            let q = backend.upload_queries(&shape, &problem.data.q)?;
            let shard = Shard::whole(&before);
            let view = TreeView::new(&before, &shard);
            for method in Method::ALL.into_iter().chain([Method::Auto]) {
                let planned = plan(&view, method, &shape, &PlannerConfig::default())?;
                let mut dplan = backend.upload_plan(&shape, &planned)?;
                backend.extend_plan(&mut dplan, &tails)?;
                let mut partials = backend.alloc_partials(&shape, &dplan)?;
                let mut states = backend.alloc_states(&shape, after.num_queries())?;
                backend.poison(&mut partials)?;
                backend.poison(&mut states)?;
                backend.step(&kv, &q, &dplan, &mut partials, &mut states)?;
                let got = backend.download(&states)?;
                let err = relative_error(&got.o, &oracle);
                let tol = tolerance(dtype);
                out.push(CaseResult {
                    name: format!(
                        "grown-{name} {dtype} h{}/{}x{} {method} extended in place",
                        shape.q_heads, shape.kv_heads, shape.head_dim
                    ),
                    rel_error: err,
                    tolerance: tol,
                    passed: err < tol && got.lse.iter().all(|x| !x.is_nan()),
                });
            }
        }
    }
    Ok(out)
}

/// Plans written over uploaded ones ([`Backend::replan`]): a long root under one
/// leaf, planned and uploaded, then the leaf grows past its pages and the grown tree's plan
/// replaces the uploaded one, in place where the backend finds that it lays out alike (as a
/// generation's replans mostly do), else uploaded afresh. The step must match the oracle on
/// the grown tree, and a plan rewritten in place must give a fresh upload's bits exactly.
pub fn replan_cases<B: Backend>(backend: &B, seed: u64) -> Result<Vec<CaseResult>> {
    let build = |leaf: u32| {
        let mut b = TreeBuilder::new().with_alignment(16);
        let root = b.add_root(3000);
        let leaf = b.add_child(root, leaf).expect("parent exists");
        b.add_query(leaf).expect("node exists");
        b.build().expect("valid")
    };
    let (before, after) = (build(7), build(7 + 40));
    let shape = AttnShape::new(8, 2, 128)?;
    let mut out = Vec::new();
    for (d, dtype) in DType::ALL.into_iter().enumerate() {
        let problem = Problem::random(after.clone(), shape, dtype, seed ^ (0xBB67 + d as u64));
        let oracle = problem.oracle();
        let mut kv = backend.alloc_kv(&shape, dtype, after.total_tokens() as usize)?;
        backend.write_kv(&mut kv, 0, &problem.data.k, &problem.data.v)?;
        let q = backend.upload_queries(&shape, &problem.data.q)?;
        let plan_of = |tree: &KvTree, method| {
            let shard = Shard::whole(tree);
            plan(
                &TreeView::new(tree, &shard),
                method,
                &shape,
                &PlannerConfig::default(),
            )
        };
        let run = |dplan: &B::Plan, partials: &mut B::States| -> Result<_> {
            let mut states = backend.alloc_states(&shape, after.num_queries())?;
            backend.poison(partials)?;
            backend.poison(&mut states)?;
            backend.step(&kv, &q, dplan, partials, &mut states)?;
            backend.download(&states)
        };
        for method in Method::ALL.into_iter().chain([Method::Auto]) {
            let grown = plan_of(&after, method)?;
            let mut dplan = backend.upload_plan(&shape, &plan_of(&before, method)?)?;
            let mut partials = backend.alloc_partials(&shape, &dplan)?;
            let in_place = backend.replan(&shape, &mut dplan, &grown)?;
            if !in_place {
                partials = backend.alloc_partials(&shape, &dplan)?;
            }
            let got = run(&dplan, &mut partials)?;
            let fresh_plan = backend.upload_plan(&shape, &grown)?;
            let mut fresh_partials = backend.alloc_partials(&shape, &fresh_plan)?;
            let fresh = run(&fresh_plan, &mut fresh_partials)?;
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            let same_bits = bits(&got.o) == bits(&fresh.o) && bits(&got.lse) == bits(&fresh.lse);
            let err = relative_error(&got.o, &oracle);
            let tol = tolerance(dtype);
            out.push(CaseResult {
                name: format!(
                    "replanned {dtype} h{}/{}x{} {method} {}",
                    shape.q_heads,
                    shape.kv_heads,
                    shape.head_dim,
                    if in_place {
                        "in place"
                    } else {
                        "uploaded afresh"
                    }
                ),
                rel_error: err,
                tolerance: tol,
                passed: err < tol && same_bits && got.lse.iter().all(|x| !x.is_nan()),
            });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::replan_cases;
    use crate::CpuBackend;

    /// The CPU backend rewrites a plan of the same rows in place, and the rewritten plan
    /// gives the oracle's answer and a fresh upload's bits.
    #[test]
    fn the_cpu_replans_in_place_and_matches() {
        let cases = replan_cases(&CpuBackend, 3).unwrap();
        assert!(!cases.is_empty());
        for c in cases {
            assert!(c.passed, "{} (error {})", c.name, c.rel_error);
            assert!(c.name.ends_with("in place"), "{}", c.name);
        }
    }
}
