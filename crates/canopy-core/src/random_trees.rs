//! Seeded random trees for checking `auto` beyond the workloads it was fitted on (issue 25).
//!
//! A draw is one of FastTree's level arrays, a DeFT workload (few-shot, tree-of-thought,
//! speculative) with random parameters, or a random explicit tree ([`crate::random_tree`] at
//! larger sizes). Each is a [`TreeSpec`] built by [`crate::workload::build_tree`], the same
//! construction the shipped workloads use, and named so that the name says what it is and
//! [`draw`] with the seed and index in the name gives it back.

use crate::error::Result;
use crate::tree::{KvTree, NamedNode};
use crate::workload::{build_tree, random_tree, TreeSpec};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Tokens a draw may hold at most: a CPU run of every method over it stays cheap.
pub const MAX_TOKENS: u32 = 300_000;

/// Leaves (live queries) of a FastTree-style draw at most, as in FastTree's largest trees.
pub const MAX_LEAVES: u32 = 1024;

/// One random tree: a name that says what it is and reproduces it, and its generator.
#[derive(Debug, Clone, PartialEq)]
pub struct Draw {
    pub name: String,
    pub spec: TreeSpec,
}

impl Draw {
    pub fn build(&self) -> Result<KvTree> {
        build_tree(&self.spec)
    }
}

/// Draw `i` of `seed`: the same tree on every call and every machine (ChaCha8 seeded from
/// both).
pub fn draw(seed: u64, i: u64) -> Draw {
    // The seed is spread over all 64 bits before the index is mixed in, so that draw i of seed
    // s and draw i' of s + 1 do not share a stream.
    let mut rng = ChaCha8Rng::seed_from_u64(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ i);
    let tag = format!("s{seed}-i{i}");
    // FastTree's level arrays are the widest family; half the draws.
    match rng.gen_range(0..8) {
        0..=3 => fasttree(&mut rng, &tag),
        4 => few_shot(&mut rng, &tag),
        5 => tot(&mut rng, &tag),
        6 => spec(&mut rng, &tag),
        _ => explicit(&mut rng, &tag),
    }
}

/// The draw a name stands for (`ft-s7-i12:…` is draw 12 of seed 7), if the name is one
/// [`draw`] gives: results saved with the name alone can be re-planned.
pub fn from_name(name: &str) -> Option<Draw> {
    let head = name.split(':').next()?;
    let mut parts = head.rsplitn(3, '-');
    let i = parts.next()?.strip_prefix('i')?.parse().ok()?;
    let seed = parts.next()?.strip_prefix('s')?.parse().ok()?;
    Some(draw(seed, i)).filter(|d| d.name == name)
}

/// Draws `0..n` of `seed`.
pub fn draws(seed: u64, n: usize) -> Vec<Draw> {
    (0..n as u64).map(|i| draw(seed, i)).collect()
}

/// A power of two between `2^lo` and `2^hi`, log-uniform.
fn log2_uniform(rng: &mut ChaCha8Rng, lo: u32, hi: u32) -> u32 {
    1 << rng.gen_range(lo..=hi)
}

/// Tokens between 1 and 8192, log-uniform (not only powers of two).
fn log_tokens(rng: &mut ChaCha8Rng) -> u32 {
    2f64.powf(rng.gen_range(0.0..=13.0))
        .round()
        .clamp(1.0, 8192.0) as u32
}

fn list(v: &[u32]) -> String {
    v.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

fn fasttree(rng: &mut ChaCha8Rng, tag: &str) -> Draw {
    let depth = rng.gen_range(2..=6usize);
    let leaves = log2_uniform(rng, 2, MAX_LEAVES.ilog2());
    let roots = if rng.gen_bool(0.7) {
        1
    } else {
        rng.gen_range(2..=4).min(leaves)
    };
    // Node counts grow down the levels: sorted exponents between the roots' and the leaves'.
    let (lo, hi) = (f64::from(roots).log2(), f64::from(leaves).log2());
    let mut exps: Vec<f64> = (0..depth - 2).map(|_| rng.gen_range(lo..=hi)).collect();
    exps.sort_by(f64::total_cmp);
    let mut nodes = vec![roots];
    nodes.extend(exps.iter().map(|e| 2f64.powf(*e).round() as u32));
    nodes.push(leaves);
    for l in 1..nodes.len() {
        nodes[l] = nodes[l].max(nodes[l - 1]);
    }
    let mut tokens: Vec<u32> = (0..depth).map(|_| log_tokens(rng)).collect();
    let total: u64 = nodes
        .iter()
        .zip(&tokens)
        .map(|(&n, &t)| u64::from(n) * u64::from(t))
        .sum();
    if total > u64::from(MAX_TOKENS) {
        // Shrinks every level alike, keeping the levels' proportions.
        let factor = total.div_ceil(u64::from(MAX_TOKENS));
        for t in &mut tokens {
            *t = (u64::from(*t) / factor).max(1) as u32;
        }
    }
    Draw {
        name: format!("ft-{tag}:levels={}/tokens={}", list(&nodes), list(&tokens)),
        spec: TreeSpec::Fasttree {
            nodes_per_level: nodes,
            tokens_per_level: tokens,
        },
    }
}

fn few_shot(rng: &mut ChaCha8Rng, tag: &str) -> Draw {
    let (prompt, branches, generated) = (
        rng.gen_range(500..=8000),
        rng.gen_range(5..=60),
        rng.gen_range(1..=400),
    );
    Draw {
        name: format!("fewshot-{tag}:prompt={prompt}/branches={branches}/generated={generated}"),
        spec: TreeSpec::FewShot {
            prompt,
            branches,
            generated,
        },
    }
}

/// Ranges around the shipped tot-* workloads (width 10, depth 3–10, thoughts 30–740).
fn tot(rng: &mut ChaCha8Rng, tag: &str) -> Draw {
    let (prompt, width, depth, thought) = (
        rng.gen_range(500..=8000),
        rng.gen_range(2..=16),
        rng.gen_range(2..=10),
        rng.gen_range(10..=800),
    );
    Draw {
        name: format!("tot-{tag}:prompt={prompt}/width={width}/depth={depth}/thought={thought}"),
        spec: TreeSpec::Tot {
            prompt,
            width,
            depth,
            thought,
        },
    }
}

/// Ranges around the shipped spec-t* workloads (32–256 tokens at depth 4).
fn spec(rng: &mut ChaCha8Rng, tag: &str) -> Draw {
    let depth = rng.gen_range(2..=6);
    let (prompt, tokens) = (
        rng.gen_range(500..=8000),
        rng.gen_range(16..=256).max(depth),
    );
    Draw {
        name: format!("spec-{tag}:prompt={prompt}/tokens={tokens}/depth={depth}"),
        spec: TreeSpec::Spec {
            prompt,
            tokens,
            depth,
        },
    }
}

/// [`random_tree`] as named nodes; its own seed is drawn, so the name carries it too.
fn explicit(rng: &mut ChaCha8Rng, tag: &str) -> Draw {
    let (tree_seed, max_nodes, max_tokens) = (
        rng.gen::<u32>() as u64,
        rng.gen_range(8..=200usize),
        rng.gen_range(16..=1500u32),
    );
    let tree = random_tree(tree_seed, max_nodes, max_tokens);
    let mut queries = vec![0u32; tree.nodes().len()];
    for q in 0..tree.num_queries() as u32 {
        queries[tree.query_node(q) as usize] += 1;
    }
    let nodes = tree
        .nodes()
        .iter()
        .zip(&queries)
        .enumerate()
        .map(|(i, (n, &q))| NamedNode {
            id: format!("n{i}"),
            parent: n.parent.map(|p| format!("n{p}")),
            tokens: n.len(),
            queries: q,
        })
        .collect();
    Draw {
        name: format!(
            "explicit-{tag}:random_tree({tree_seed},{max_nodes},{max_tokens})/nodes={}/tokens={}",
            tree.nodes().len(),
            tree.total_tokens()
        ),
        spec: TreeSpec::Explicit { nodes },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::planner::{
        auto_candidates, auto_choices, choose, plan, predictions, Method, PlannerConfig,
    };
    use crate::shape::AttnShape;
    use crate::shard::{shard_tree, Shard, TreeView};
    use crate::DeviceModel;
    use proptest::prelude::*;

    #[test]
    fn draws_are_deterministic_and_distinct() {
        assert_eq!(draws(3, 40), draws(3, 40));
        let mut names: Vec<String> = draws(3, 200).into_iter().map(|d| d.name).collect();
        names.extend(draws(4, 200).into_iter().map(|d| d.name));
        let n = names.len();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), n);
    }

    #[test]
    fn names_give_their_draws_back() {
        for d in draws(5, 50) {
            assert_eq!(from_name(&d.name).as_ref(), Some(&d));
        }
        let name = draw(5, 3).name;
        let other_seed = name.replacen("-s5-", "-s6-", 1);
        for bad in ["", "ft", "fasttree-4", "ft-s5-ix:levels=1", &other_seed] {
            assert!(from_name(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn every_family_occurs_and_sizes_are_bounded() {
        let mut seen = std::collections::BTreeSet::new();
        for d in draws(11, 300) {
            seen.insert(d.name.split('-').next().unwrap_or_default().to_string());
            let t = d.build().unwrap_or_else(|e| panic!("{}: {e}", d.name));
            assert!(t.num_queries() >= 1, "{}", d.name);
            assert!(t.total_tokens() <= MAX_TOKENS, "{}", d.name);
            if let TreeSpec::Fasttree {
                nodes_per_level, ..
            } = &d.spec
            {
                assert!((2..=6).contains(&nodes_per_level.len()), "{}", d.name);
                assert!(
                    nodes_per_level.windows(2).all(|w| w[0] <= w[1]),
                    "{}",
                    d.name
                );
                assert!(t.num_queries() as u32 <= MAX_LEAVES, "{}", d.name);
            }
        }
        let want = ["explicit", "fewshot", "ft", "spec", "tot"];
        assert_eq!(seen.into_iter().collect::<Vec<_>>(), want);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4))]
        #[test]
        fn every_planner_accepts_every_draw(seed in any::<u64>()) {
            let shape = AttnShape { q_heads: 32, kv_heads: 8, head_dim: 128, scale: None };
            let cfg = PlannerConfig::whole_paths();
            let model = DeviceModel::default();
            for d in draws(seed, 12) {
                let tree = d.build().unwrap();
                let shard = Shard::whole(&tree);
                let view = TreeView::new(&tree, &shard);
                for m in Method::ALL {
                    prop_assert!(plan(&view, m, &shape, &cfg).is_ok(), "{} {m}", d.name);
                }
                prop_assert!(choose(&view, &shape, &cfg, &model).is_ok(), "{}", d.name);
            }
        }

        /// Q-guided's floor counted on the view is the floor of its plan of whole paths, on
        /// drawn trees whole and on every rank's shard (where some queries read nothing).
        #[test]
        fn q_guided_floor_counts_its_plan(seed in any::<u64>(), ranks in 1usize..5) {
            let model = DeviceModel::default();
            let cfg = auto_candidates(&PlannerConfig::default())
                .into_iter()
                .find(|(m, _)| *m == Method::QGuided)
                .expect("auto tries q-guided")
                .1;
            for d in draws(seed, 8) {
                let tree = d.build().unwrap();
                for shard in shard_tree(&tree, ranks).unwrap() {
                    let view = TreeView::new(&tree, &shard);
                    for shape in [AttnShape::new(32, 8, 128).unwrap(), AttnShape::new(9, 3, 64).unwrap()] {
                        let want = model.floor_us(&plan(&view, Method::QGuided, &shape, &cfg).unwrap(), &shape);
                        let got = model.q_guided_floor_us(&view, &shape);
                        prop_assert_eq!(got, want, "{} on {} ranks", d.name, ranks);
                    }
                }
            }
        }

        /// `choose` prices fewer candidates than `auto_choices` and picks as it does: every
        /// plan's floor is under its prediction, on drawn trees and on a server's prefill
        /// passes (prompt rows on the node their cached prefix ends on, beside decode leaves).
        #[test]
        fn choose_picks_what_every_candidate_priced_picks(
            seed in any::<u64>(),
            prompt_rows in 1usize..3000,
            leaves in 0usize..80,
            prefix in 1u32..9000,
        ) {
            let model = DeviceModel::default();
            let cfg = PlannerConfig::default();
            let mut trees: Vec<(String, KvTree)> =
                draws(seed, 6).into_iter().map(|d| (d.name.clone(), d.build().unwrap())).collect();
            let mut b = crate::tree::TreeBuilder::new();
            let root = b.add_root(prefix);
            for _ in 0..prompt_rows {
                b.add_query(root).unwrap();
            }
            for _ in 0..leaves {
                let leaf = b.add_child(root, 1 + prefix % 97).unwrap();
                b.add_query(leaf).unwrap();
            }
            trees.push((format!("prefill-{prompt_rows}-{leaves}-{prefix}"), b.build().unwrap()));
            for shape in [AttnShape::new(32, 8, 128).unwrap(), AttnShape::new(9, 3, 64).unwrap()] {
                for (name, tree) in &trees {
                    let shard = Shard::whole(tree);
                    let view = TreeView::new(tree, &shard);
                    let every = auto_choices(&view, &shape, &cfg, &model).unwrap();
                    for c in &every {
                        let floor = model.floor_us(&c.plan, &shape);
                        prop_assert!(floor <= c.predicted_us * (1.0 + 1e-12), "{name} {}: {floor} over {}", c.method, c.predicted_us);
                    }
                    let want = &every[model.pick(&predictions(&every)).unwrap()];
                    let got = choose(&view, &shape, &cfg, &model).unwrap();
                    prop_assert_eq!(got.method, want.method, "{}", name);
                    prop_assert_eq!(got.predicted_us, want.predicted_us, "{}", name);
                }
            }
        }
    }
}
