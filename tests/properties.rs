//! Property tests: random trees × GQA shapes × every planner × every strategy on up to eight
//! simulated ranks against the f64 oracle; planner coverage and IO; merge algebra.

use canopy_comm::{Group, ThreadWorld};
use canopy_core::AttnStates;
use canopy_core::{
    geometry::cut_for_gpu, merge_state, plan, random_tree, relative_error, shard_tree, AttnShape,
    DType, Method, PlannerConfig, Shard, TreeView, EMPTY_LSE,
};
use canopy_engine::{
    run_threads, CpuBackend, MergeCollective, NodeLayout, Problem, RunConfig, StatesMerge,
    Strategy as Decode,
};
use proptest::prelude::*;
use std::time::Duration;

fn shapes() -> impl Strategy<Value = AttnShape> {
    prop_oneof![
        Just(AttnShape::new(4, 4, 64).unwrap()),
        Just(AttnShape::new(8, 2, 64).unwrap()),
        Just(AttnShape::new(4, 1, 128).unwrap()),
        Just(AttnShape::new(2, 2, 256).unwrap()),
    ]
}

fn dtypes() -> impl Strategy<Value = DType> {
    prop_oneof![Just(DType::F32), Just(DType::Bf16), Just(DType::F16)]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn every_planner_and_strategy_matches_the_oracle(
        seed in any::<u64>(), ranks in 1usize..=8, shape in shapes(), dtype in dtypes(),
    ) {
        let tree = random_tree(seed, 16, 40);
        let problem = Problem::random(tree, shape, dtype, seed);
        let oracle = problem.oracle();
        let tol = if dtype == DType::F32 { 1e-5 } else { 1e-2 };
        for method in Method::ALL {
            for strategy in Decode::every() {
                let cfg = RunConfig {
                    ranks, strategy, method, planner: PlannerConfig::default(),
                    warmup: 0, iters: 1, cache: canopy_engine::Cache::Warm, timeout: Duration::from_secs(60), poison: true,
                    virtual_nodes: (ranks % 2 == 0).then_some(2),
                    stall_rank: None,
                };
                let r = run_threads(&problem, &cfg, Some(&oracle), |_| Ok(CpuBackend)).unwrap();
                let err = r.rel_error.unwrap();
                prop_assert!(err < tol, "{method} {} p={ranks}: rel error {err}", strategy.name());
                let out = r.output.as_ref().expect("rank 0's output");
                prop_assert!(out.o.iter().chain(&out.lse).all(|x| !x.is_nan()), "NaN output");
                let spread = r.rank_spread.expect("every rank compared");
                prop_assert!(spread < 1e-6, "ranks disagree by {spread}");
            }
        }
    }

    #[test]
    fn every_planner_covers_each_context_exactly_once(
        seed in any::<u64>(), ranks in 1usize..=8, block in 1u32..200, chunk in 1u32..300,
        slots in 1usize..500,
    ) {
        let tree = random_tree(seed, 40, 64);
        let shape = AttnShape::new(8, 2, 128).unwrap();
        let cfg = PlannerConfig { flatten_block: block, node_chunk: chunk, q_guided_chunk: chunk,
            flatten_query_chunk: (seed % 3 == 0).then_some(1 + (seed % 7) as u32), ..PlannerConfig::default() };
        for shard in shard_tree(&tree, ranks).unwrap() {
            let view = TreeView::new(&tree, &shard);
            for method in Method::ALL {
                let p = plan(&view, method, &shape, &cfg).unwrap();
                if let Err(e) = p.check_coverage(|q| view.query_context(q)) {
                    return Err(TestCaseError::fail(format!("{method} rank {}: {e}", shard.rank)));
                }
                // As the CUDA backend runs it: cut into CTAs (masked pieces trimmed).
                let (cut, _) = cut_for_gpu(&p, &shape, slots);
                if let Err(e) = cut.check_coverage(|q| view.query_context(q)) {
                    return Err(TestCaseError::fail(format!("{method} cut for {slots} slots, rank {}: {e}", shard.rank)));
                }
            }
        }
    }

    #[test]
    fn deft_reads_live_tokens_once_and_q_guided_reads_every_path(seed in any::<u64>()) {
        let tree = random_tree(seed, 40, 64);
        let shape = AttnShape::new(32, 8, 128).unwrap();
        let shard = Shard::whole(&tree);
        let view = TreeView::new(&tree, &shard);
        let cfg = PlannerConfig::default();
        let live: u64 = tree.nodes().iter().enumerate()
            .filter(|(i, _)| !tree.queries_through(*i as u32).is_empty())
            .map(|(_, n)| n.len() as u64).sum();
        let paths: u64 = (0..tree.num_queries() as u32).map(|q| tree.query_context_len(q)).sum();
        let token_bytes = 2 * 8 * 128 * 2;
        for (method, want) in [(Method::DeftFlatten, live), (Method::DeftNode, live), (Method::DeftNodeChunk, live), (Method::QGuided, paths)] {
            let io = plan(&view, method, &shape, &cfg).unwrap().io(&shape, DType::F16);
            prop_assert_eq!(io.kv_tokens_read, want, "{}", method);
            prop_assert_eq!(io.kv_bytes, want * token_bytes);
        }
    }

    #[test]
    fn merge_is_associative_and_empty_is_identity(
        a in prop::collection::vec(-3.0f32..3.0, 8), b in prop::collection::vec(-3.0f32..3.0, 8),
        c in prop::collection::vec(-3.0f32..3.0, 8), l in prop::collection::vec(-20.0f32..20.0, 3),
        empties in prop::collection::vec(any::<bool>(), 3),
    ) {
        let lse: Vec<f32> = l.iter().zip(&empties).map(|(&x, &e)| if e { EMPTY_LSE } else { x }).collect();
        // The empty partial is canonical: o = 0 with lse = -inf.
        let st = |o: &[f32], l: f32| (if l == EMPTY_LSE { vec![0.0; o.len()] } else { o.to_vec() }, l);
        let merge = |(mut o, mut l): (Vec<f32>, f32), (o2, l2): (Vec<f32>, f32)| { merge_state(&mut o, &mut l, &o2, l2); (o, l) };
        let (a, b, c) = (st(&a, lse[0]), st(&b, lse[1]), st(&c, lse[2]));
        let left = merge(merge(a.clone(), b.clone()), c.clone());
        let right = merge(a.clone(), merge(b.clone(), c.clone()));
        prop_assert!(!left.1.is_nan() && left.0.iter().all(|x| !x.is_nan()));
        if left.1 == EMPTY_LSE {
            prop_assert_eq!(right.1, EMPTY_LSE);
        } else {
            prop_assert!((left.1 - right.1).abs() <= 1e-5 * left.1.abs().max(1.0));
            let want: Vec<f64> = right.0.iter().map(|&x| x as f64).collect();
            prop_assert!(relative_error(&left.0, &want) < 1e-5 || want.iter().all(|&x| x.abs() < 1e-6));
        }
        let empty = (vec![0.0; 8], EMPTY_LSE);
        let with_empty = merge(a.clone(), empty.clone());
        prop_assert_eq!(&with_empty, &a.clone());
        prop_assert_eq!(merge(empty, a.clone()), a);
    }

    /// The scattered merge gives each rank its own block of rows in the all-reduce merge's
    /// bits, over 1-6 ranks, with cells empty on some ranks or on all.
    #[test]
    fn a_scattered_merge_gives_each_rank_its_block_of_the_all_reduce_merge(
        seed in any::<u64>(), ranks in 1usize..=6, rows_a_rank in 1usize..=3, heads in 1usize..=3,
        d in prop_oneof![Just(4usize), Just(64)],
    ) {
        let rows = ranks * rows_a_rank;
        let cells = rows * heads;
        let mut state = seed;
        let mut next = move || {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (state >> 40) as f32 / (1u64 << 24) as f32
        };
        let inputs: Vec<AttnStates> = (0..ranks)
            .map(|_| {
                let mut s = AttnStates::empty(rows, heads, d);
                for c in 0..cells {
                    if next() < 0.2 || c % 7 == 5 {
                        continue; // empty on this rank (cell 5 of each 7 on every rank)
                    }
                    s.lse[c] = next() * 30.0 - 15.0;
                    s.o[c * d..(c + 1) * d].iter_mut().for_each(|o| *o = next() * 4.0 - 2.0);
                }
                s
            })
            .collect();
        let out = ThreadWorld::run(ranks, Duration::from_secs(60), |comm| {
            let b = CpuBackend;
            let layout = NodeLayout::single(ranks);
            let mut merge = StatesMerge::new(&b, cells, d, ranks)?;
            let mut whole = inputs[comm.rank()].clone();
            merge.run(&b, &comm, &mut whole, MergeCollective::Allreduce2, &layout)?;
            let mut scattered = inputs[comm.rank()].clone();
            merge.run_scattered(&b, &comm, &mut scattered)?;
            Ok::<_, canopy_engine::EngineError>((whole, scattered))
        });
        let block = rows_a_rank * heads;
        for (r, res) in out.into_iter().enumerate() {
            let (whole, scattered) = res.unwrap();
            let cells_of = r * block..(r + 1) * block;
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            prop_assert_eq!(bits(&scattered.lse[cells_of.clone()]), bits(&whole.lse[cells_of.clone()]));
            let elems = cells_of.start * d..cells_of.end * d;
            prop_assert_eq!(bits(&scattered.o[elems.clone()]), bits(&whole.o[elems]));
        }
    }
}
