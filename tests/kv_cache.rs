//! The KV cache over ranks (canopy-kv) against the planners and the f64 oracle: random trees
//! grown step by step (decode steps, prefills, forks, prunes, queries moved) over 1 to 4
//! ranks. Every step, each rank's view is followed as a decode loop follows it
//! ([`StepLayout`]), planned with every method (afresh or extended in place), and its
//! attention, read through its page table and merged across ranks, is the whole tree's.

use canopy_core::data::hashed_queries;
use canopy_core::{
    merge_state, plan, reference_attention, relative_error, AttnShape, DType, HashedKv, KvSource,
    KvTree, Method, PagedKv, Plan, PlannerConfig, Shard, TreeBuilder, TreeView,
};
use canopy_kv::{KvManager, KvNode, Placement, RankUpdate, StepLayout};
use proptest::prelude::*;
use std::collections::HashSet;

const PAGES_PER_RANK: u32 = 4096;

/// One rank's pool: its slots are slots `base..` of one hashed store, so every value is a
/// function of (rank, physical page, offset) and a token read from the wrong page, the wrong
/// rank or twice changes the result.
struct RankPool<'a> {
    base: usize,
    store: &'a HashedKv,
}

impl KvSource for RankPool<'_> {
    fn rows(&self, token: usize, kv_head: usize, k: &mut [f32], v: &mut [f32]) {
        self.store.rows(self.base + token, kv_head, k, v);
    }
}

/// The unsharded tree's KV: address `a` is the store slot that holds it.
struct Slots<'a> {
    slots: Vec<usize>,
    store: &'a HashedKv,
}

impl KvSource for Slots<'_> {
    fn rows(&self, token: usize, kv_head: usize, k: &mut [f32], v: &mut [f32]) {
        self.store.rows(self.slots[token], kv_head, k, v);
    }
}

fn slot_of(rank: usize, page: u32, offset: u32, page_size: u32) -> usize {
    ((rank as u64 * PAGES_PER_RANK as u64 + page as u64) * page_size as u64 + offset as u64)
        as usize
}

/// The cache's tree packed on one rank, queries in [`KvManager::live`] order, with the store
/// slot of every address.
fn whole_tree(kv: &KvManager, nodes: &[KvNode]) -> (KvTree, Vec<usize>) {
    let mut b = TreeBuilder::new();
    let mut ids = vec![None; nodes.iter().max().map_or(0, |&n| n as usize + 1)];
    // Node handles grow with creation, so parents come first.
    let mut sorted = nodes.to_vec();
    sorted.sort_unstable();
    for &n in &sorted {
        let len = kv.len(n).unwrap();
        ids[n as usize] = Some(match kv.parent(n).unwrap() {
            None => b.add_root(len),
            Some(p) => b.add_child(ids[p as usize].unwrap(), len).unwrap(),
        });
    }
    for n in kv.live() {
        b.add_query(ids[n as usize].unwrap()).unwrap();
    }
    let tree = b.build().unwrap();
    let page = kv.page_size();
    let mut slots = vec![0; tree.total_tokens() as usize];
    for &n in &sorted {
        let start = tree.node(ids[n as usize].unwrap()).kv.start;
        for t in 0..kv.len(n).unwrap() {
            let p = kv.pages(n).unwrap()[(t / page) as usize];
            slots[(start + t) as usize] = slot_of(p.rank, p.page, t % page, page);
        }
    }
    (tree, slots)
}

/// `merge_state` in f64, for a comparison at 1e-9.
fn merge64(o_a: &mut [f64], lse_a: &mut f64, o_b: &[f64], lse_b: f64) {
    if lse_b == f64::NEG_INFINITY {
        return;
    }
    if *lse_a == f64::NEG_INFINITY {
        o_a.copy_from_slice(o_b);
        *lse_a = lse_b;
        return;
    }
    let m = lse_a.max(lse_b);
    let (wa, wb) = ((*lse_a - m).exp(), (lse_b - m).exp());
    for (a, &b) in o_a.iter_mut().zip(o_b) {
        *a = (*a * wa + b * wb) / (wa + wb);
    }
    *lse_a = m + (wa + wb).ln();
}

#[derive(Debug, Clone)]
enum Op {
    /// Every live leaf appends one token, placed balanced.
    Decode,
    /// A branch of `tokens` under node `at`, live.
    Fork {
        at: usize,
        tokens: u32,
        contiguous: bool,
    },
    /// A new sequence of `tokens`, prefilled contiguously, live.
    Root { tokens: u32 },
    /// A prefill chunk of `tokens` appended to node `at` (if a leaf), contiguously.
    Extend { at: usize, tokens: u32 },
    /// Node `at` and its subtree pruned (never the last root).
    Prune { at: usize },
    /// A query put on node `at`, or taken off it.
    Query { at: usize },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => Just(Op::Decode),
        2 => (any::<usize>(), 1u32..40, any::<bool>())
            .prop_map(|(at, tokens, contiguous)| Op::Fork { at, tokens, contiguous }),
        1 => (1u32..120).prop_map(|tokens| Op::Root { tokens }),
        1 => (any::<usize>(), 1u32..90).prop_map(|(at, tokens)| Op::Extend { at, tokens }),
        1 => any::<usize>().prop_map(|at| Op::Prune { at }),
        1 => any::<usize>().prop_map(|at| Op::Query { at }),
    ]
}

fn apply(kv: &mut KvManager, nodes: &mut Vec<KvNode>, op: &Op) {
    let pick = |at: usize| nodes[at % nodes.len()];
    match *op {
        Op::Decode => {
            for n in kv.live() {
                // Queries on inner nodes do not grow.
                let _ = kv.append(n, 1, Placement::Balanced);
            }
        }
        Op::Fork {
            at,
            tokens,
            contiguous,
        } => {
            let placement = match contiguous {
                true => Placement::Contiguous,
                false => Placement::Balanced,
            };
            let n = kv.fork(pick(at), tokens, placement).unwrap();
            kv.set_live(n, true).unwrap();
            nodes.push(n);
        }
        Op::Root { tokens } => {
            let n = kv.add_root(tokens, Placement::Contiguous).unwrap();
            kv.set_live(n, true).unwrap();
            nodes.push(n);
        }
        Op::Extend { at, tokens } => {
            let _ = kv.append(pick(at), tokens, Placement::Contiguous);
        }
        Op::Prune { at } => {
            let n = pick(at);
            let roots = nodes
                .iter()
                .filter(|&&m| kv.parent(m).unwrap().is_none())
                .count();
            if kv.parent(n).unwrap().is_some() || roots > 1 {
                kv.prune(n).unwrap();
                nodes.retain(|&m| kv.len(m).is_ok());
            }
        }
        Op::Query { at } => {
            let n = pick(at);
            let live = kv.live().contains(&n);
            kv.set_live(n, !live).unwrap();
        }
    }
}

fn fresh_plan(tree: &KvTree, method: Method, shape: &AttnShape) -> Plan {
    let cfg = PlannerConfig {
        node_chunk: 7,
        flatten_block: 5,
        ..PlannerConfig::default()
    };
    let shard = Shard::whole(tree);
    plan(&TreeView::new(tree, &shard), method, shape, &cfg).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    /// For every step: (a) every token of every node is held by exactly one rank, in pages no
    /// other node holds; (b) the ranks' trees keep the cache's topology and queries, and their
    /// node lengths sum to the node's; (c) each rank's view brought up to date in place (when
    /// it could be) is the fresh snapshot (without growth room; with it, live leaves keep
    /// their addresses and take pages into their room), and plans extended by its tails cover
    /// every context exactly, for every method; (d) attention per rank, read through the
    /// rank's page table and merged across ranks, is attention over the whole unsharded tree.
    #[test]
    fn ranks_hold_every_token_once_and_merge_to_the_whole_tree(
        ranks in 1usize..=4,
        page in 1u32..=8,
        prompt in 1u32..120,
        leaves in 1usize..4,
        ops in proptest::collection::vec(op(), 1..24),
        seed in any::<u64>(),
        room in prop_oneof![Just(0u32), 1u32..24],
    ) {
        let shape = AttnShape::new(4, 2, 64).unwrap();
        let store = HashedKv { seed, dtype: DType::F32, kv_heads: shape.kv_heads };
        let mut kv = KvManager::new(ranks, page, PAGES_PER_RANK).unwrap().with_growth_room(room);
        let root = kv.add_root(prompt, Placement::Contiguous).unwrap();
        let mut nodes = vec![root];
        for i in 0..leaves {
            let fork = Op::Fork { at: 0, tokens: 1 + 3 * i as u32, contiguous: false };
            apply(&mut kv, &mut nodes, &fork);
        }
        let mut layout = StepLayout::new();
        let mut plans: Vec<Vec<Plan>> = Vec::new();
        for (step, op) in ops.iter().enumerate() {
            apply(&mut kv, &mut nodes, op);

            // (a) Each node's pages cover its tokens once, in runs of one rank; no page twice.
            let mut owned = HashSet::new();
            for &n in &nodes {
                let len = kv.len(n).unwrap();
                let pages = kv.pages(n).unwrap();
                prop_assert_eq!(pages.len() as u32, len.div_ceil(page));
                let mut next = 0;
                for (rank, run) in kv.runs(n).unwrap() {
                    prop_assert_eq!(run.start, next, "node {}: runs tile its tokens", n);
                    prop_assert!(rank < ranks && run.end > run.start);
                    next = run.end;
                }
                prop_assert_eq!(next, len);
                for p in pages {
                    prop_assert!(p.page < PAGES_PER_RANK && owned.insert(*p), "{:?} twice", p);
                }
            }
            let used: usize = (0..ranks).map(|r| kv.pages_in_use_on(r).unwrap()).sum();
            prop_assert_eq!(owned.len(), used);

            // (c) Follow the ranks as a decode loop does; in-place updates equal fresh views.
            let updates = layout.update(&kv).unwrap();
            prop_assert_eq!(updates.len(), ranks);
            if plans.is_empty() {
                plans = vec![Vec::new(); ranks];
            }
            for (r, update) in updates.into_iter().enumerate() {
                match update {
                    RankUpdate::Fresh(snap) => {
                        let fresh = Method::ALL.iter().map(|&m| fresh_plan(&snap.tree, m, &shape));
                        plans[r] = fresh.collect();
                    }
                    RankUpdate::Grown { tails, .. } => {
                        prop_assert!(step > 0, "the first update is fresh");
                        plans[r].iter_mut().for_each(|p| p.extend_tails(&tails));
                    }
                }
            }
            let q = hashed_queries(&shape, DType::F32, kv.live().len(), seed ^ step as u64);
            let (whole, slots) = whole_tree(&kv, &nodes);
            let (h, d) = (shape.q_heads, shape.head_dim);
            let mut o = vec![0.0f64; whole.num_queries() * h * d];
            let mut lse = vec![f64::NEG_INFINITY; whole.num_queries() * h];
            let mut o32 = vec![0.0f32; o.len()];
            let mut lse32 = vec![f32::NEG_INFINITY; lse.len()];
            let mut lengths = vec![0u32; nodes.len()];
            for (r, rank_plans) in plans.iter().enumerate() {
                let snap = layout.rank(r).unwrap();
                if room == 0 {
                    let fresh = kv.snapshot(r).unwrap();
                    prop_assert_eq!(&snap.tree, &fresh.tree, "rank {} step {}", r, step);
                    prop_assert_eq!(&snap.table, &fresh.table, "rank {} step {}", r, step);
                }

                // (b) One topology and query order on every rank; lengths are the rank's share.
                let tree = &snap.tree;
                prop_assert_eq!(tree.num_queries(), whole.num_queries());
                prop_assert_eq!(tree.nodes().len(), nodes.len());
                for (i, &n) in nodes.iter().enumerate() {
                    let id = snap.node(n).unwrap();
                    prop_assert_eq!(tree.node(id).len(), kv.held(n).unwrap()[r]);
                    lengths[i] += tree.node(id).len();
                    let parent = kv.parent(n).unwrap().map(|p| snap.node(p).unwrap());
                    prop_assert_eq!(tree.node(id).parent, parent);
                }
                for (i, &n) in kv.live().iter().enumerate() {
                    prop_assert_eq!(tree.query_node(i as u32), snap.node(n).unwrap());
                }

                // (c) Every method's plan, made once per layout and extended in place since,
                // covers each query's context on this rank exactly once.
                let shard = Shard::whole(tree);
                let view = TreeView::new(tree, &shard);
                for (m, p) in Method::ALL.iter().zip(rank_plans) {
                    p.check_coverage(|q| view.query_context(q))
                        .map_err(|e| TestCaseError::fail(format!("rank {r} {m}: {e}")))?;
                }

                // (d) This rank's attention, through its page table into its own pool.
                let pool = RankPool { base: slot_of(r, 0, 0, page), store: &store };
                let paged = PagedKv { pool: &pool, page_size: page, table: &snap.table };
                let (ro, rl) = reference_attention(tree, &shape, &q, &paged);
                for (c, &l) in rl.iter().enumerate() {
                    merge64(&mut o[c * d..(c + 1) * d], &mut lse[c], &ro[c * d..(c + 1) * d], l);
                    let part: Vec<f32> = ro[c * d..(c + 1) * d].iter().map(|&x| x as f32).collect();
                    merge_state(&mut o32[c * d..(c + 1) * d], &mut lse32[c], &part, l as f32);
                }
            }
            for (i, &n) in nodes.iter().enumerate() {
                prop_assert_eq!(lengths[i], kv.len(n).unwrap(), "(b) node {}", n);
            }
            let whole_kv = Slots { slots, store: &store };
            let (want_o, want_lse) = reference_attention(&whole, &shape, &q, &whole_kv);
            for (i, (got, want)) in o.iter().zip(&want_o).enumerate() {
                prop_assert!((got - want).abs() < 1e-9, "step {step} o[{i}]: {got} vs {want}");
            }
            for (got, want) in lse.iter().zip(&want_lse) {
                prop_assert!((got - want).abs() < 1e-9, "step {}: lse {} vs {}", step, got, want);
            }
            // The engine's merge (f32) agrees to f32 rounding.
            prop_assert!(relative_error(&o32, &want_o) < 1e-5);
        }
    }
}
