//! Planners: every way canopy knows to group a tree's KV with its queries.
//!
//! All of them read a [`TreeView`] (the tree through one rank's windows) and return a [`Plan`],
//! so any method runs on any backend and on any shard.
//!
//! - **Q-guided** (the Radix-attention / SGLang baseline): one group per query and chunk of its
//!   root-to-leaf context. Shared prefixes are re-read by every query that shares them.
//! - **DeFT-Node**: one group per tree node with every query below it: each node's KV is read
//!   once, but node sizes are uneven.
//! - **DeFT-Node-Chunk**: DeFT-Node with nodes cut into chunks, for balance.
//! - **DeFT-Flatten**: the live tokens in depth-first order cut into even blocks; each block's
//!   queries are the union of its nodes' queries, told apart by a per-token bit mask.
//! - **FastTree**: a greedy, per-edge choice of whether a node's KV is computed once for all
//!   queries below it (one more intermediate partial per query) or pushed down into its
//!   children's groups (KV re-read, fewer partials, fuller tensor-core tiles), by a cost model;
//!   leaves shorter than a CTA's fixed cost join their parent's group under a mask; then
//!   long-context splitting when too few groups remain to fill the GPU.
//! - **Auto**: plans the tree with each method, predicts each plan's time with a
//!   [`DeviceModel`] (KV and partial bytes over bandwidth, tensor-core work over throughput,
//!   the longest CTA), and keeps the fastest ([`auto_candidates`]). A growing tree is planned
//!   afresh only when its layout moves (about once per page of growth: the `canopy_kv`
//!   cache), so trying every candidate then is affordable.

use crate::device_model::DeviceModel;
use crate::error::{CoreError, Result};
use crate::geometry::{CTA_FIXED_WORK, CTA_ROWS};
use crate::plan::{split_ranges, Group, Plan};
use crate::shape::AttnShape;
use crate::shard::TreeView;
use serde::{Deserialize, Serialize};
use std::ops::Range;

/// A planning method.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Method {
    QGuided,
    DeftNode,
    DeftNodeChunk,
    DeftFlatten,
    #[serde(rename = "fasttree")]
    FastTree,
    /// The method and block sizes the device model predicts fastest for this tree.
    Auto,
}

impl Method {
    pub const ALL: [Method; 5] = [
        Method::QGuided,
        Method::DeftNode,
        Method::DeftNodeChunk,
        Method::DeftFlatten,
        Method::FastTree,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Method::Auto => "auto",
            Method::QGuided => "q-guided",
            Method::DeftNode => "deft-node",
            Method::DeftNodeChunk => "deft-node-chunk",
            Method::DeftFlatten => "deft-flatten",
            Method::FastTree => "fasttree",
        }
    }

    /// Parses a method name, a comma list, or `all` (every concrete method, then `auto`).
    pub fn parse_list(s: &str) -> Result<Vec<Method>> {
        if s == "all" {
            return Ok(Method::ALL.into_iter().chain([Method::Auto]).collect());
        }
        s.split(',').map(|m| m.trim().parse()).collect()
    }
}

impl std::str::FromStr for Method {
    type Err = CoreError;
    fn from_str(s: &str) -> Result<Self> {
        Method::ALL
            .into_iter()
            .chain([Method::Auto])
            .find(|m| m.name() == s)
            .ok_or_else(|| CoreError::UnknownMethod(s.to_string()))
    }
}

impl std::fmt::Display for Method {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// FastTree's cost model. Units are arbitrary but shared: `beta` is the cost of loading one
/// KV token of one KV head; the others are relative to it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct FastTreeParams {
    /// Cost per (padded query row × KV token) of tensor-core work.
    pub alpha: f64,
    /// Cost per KV token loaded.
    pub beta: f64,
    /// Cost per query row (query × GQA head) of an intermediate partial written by stage 1
    /// and read by stage 2: per KV head, a partial row of a query is `gqa` rows of f32
    /// outputs, written and read again, where a KV token is one row of K and V in 16 bits.
    pub gamma: f64,
    /// Query rows (queries × GQA group) per tensor-core tile; rows are padded to it.
    pub tile_q: usize,
    /// KV tokens per tile; groups are padded to it.
    pub tile_kv: u32,
    /// Groups × KV heads below which long groups are split (about two waves of SMs).
    pub min_parallelism: usize,
    /// Smallest chunk long-context splitting makes.
    pub min_split_tokens: u32,
}

impl Default for FastTreeParams {
    fn default() -> Self {
        FastTreeParams {
            alpha: 0.01,
            beta: 1.0,
            // Per GQA row: 4 per query at 32/8 (FastTree's own setting, as it was) pushed
            // too little down on H100. 16 took FastTree's trees 6, 7 and 9 at 32/8 from
            // 96.5, 496.9 and 114.7 µs to 77.6, 469.2 and 97.8 (docs/BENCHMARKS.md, session
            // 10).
            gamma: 16.0,
            tile_q: 16,
            tile_kv: 32,
            min_parallelism: 264,
            min_split_tokens: 256,
        }
    }
}

/// Every planner's parameters.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct PlannerConfig {
    /// Q-guided: tokens per split of each query's context.
    pub q_guided_chunk: u32,
    /// DeFT-Node-Chunk: tokens per node chunk.
    pub node_chunk: u32,
    /// DeFT-Flatten: tokens per block of the flattened tree.
    pub flatten_block: u32,
    /// DeFT-Flatten: queries per group (`None`: all of a block's queries in one group, so each
    /// token is read exactly once per KV head).
    pub flatten_query_chunk: Option<u32>,
    pub fasttree: FastTreeParams,
}

impl Default for PlannerConfig {
    fn default() -> Self {
        PlannerConfig {
            q_guided_chunk: 256,
            node_chunk: 128,
            flatten_block: 128,
            flatten_query_chunk: None,
            fasttree: FastTreeParams::default(),
        }
    }
}

impl PlannerConfig {
    /// The defaults, with Q-guided keeping each query's path in one group: for backends that
    /// split long groups themselves to fill the device (the CUDA backend does).
    pub fn whole_paths() -> PlannerConfig {
        PlannerConfig {
            q_guided_chunk: u32::MAX,
            ..PlannerConfig::default()
        }
    }
}

/// Plans `view` with `method`.
pub fn plan(
    view: &TreeView,
    method: Method,
    shape: &AttnShape,
    cfg: &PlannerConfig,
) -> Result<Plan> {
    if method == Method::Auto {
        return Ok(choose(view, shape, cfg, &DeviceModel::default())?.plan);
    }
    let groups = match method {
        Method::Auto => unreachable!("resolved above"),
        Method::QGuided => q_guided(view, cfg.q_guided_chunk),
        Method::DeftNode => deft_node(view, None),
        Method::DeftNodeChunk => deft_node(view, Some(cfg.node_chunk)),
        Method::DeftFlatten => deft_flatten(view, cfg.flatten_block, cfg.flatten_query_chunk),
        Method::FastTree => fasttree(view, shape, &cfg.fasttree),
    };
    let plan = Plan::new(view.tree.num_queries(), groups)?;
    Ok(match method {
        // FastTree's long-context splitting: enough groups × KV heads to fill the GPU.
        Method::FastTree => {
            let ft = &cfg.fasttree;
            plan.split_for_parallelism(
                ft.min_parallelism.div_ceil(shape.kv_heads),
                ft.min_split_tokens,
            )
        }
        _ => plan,
    })
}

/// The candidates `auto` compares: every method at `base`'s sizes (Q-guided with whole paths,
/// as the backends split long groups themselves). Block and chunk sizes are not searched: the
/// backend's cut ([`crate::geometry::cut_for_gpu`]) already balances long groups, and sizes the
/// benchmark never measured are where the model was wrong. Session 7 chose DeFT-Flatten with
/// 256-token blocks on FastTree's tree 8, 61 µs against 40 for the best measured method.
pub fn auto_candidates(base: &PlannerConfig) -> Vec<(Method, PlannerConfig)> {
    Method::ALL
        .into_iter()
        .map(|m| match m {
            Method::QGuided => (
                m,
                PlannerConfig {
                    q_guided_chunk: PlannerConfig::whole_paths().q_guided_chunk,
                    ..*base
                },
            ),
            _ => (m, *base),
        })
        .collect()
}

/// What `auto` chose for a tree, and the prediction it chose by.
#[derive(Debug, Clone)]
pub struct AutoChoice {
    pub method: Method,
    pub config: PlannerConfig,
    pub predicted_us: f64,
    pub plan: Plan,
}

/// Plans `view` with every candidate and keeps the one `model` picks ([`DeviceModel::pick`]:
/// the fastest predicted, unless it is not enough faster than Q-guided), as
/// [`auto_choices`] would, but leaves unpriced (at infinity) the candidates whose
/// [`DeviceModel::floor_us`] shows they cannot change the pick: the others by their partial
/// rows, fewest first, each skipped where its floor is above the fastest priced so far; then
/// Q-guided, skipped where its floor is above the fastest by more than the margin. Q-guided's
/// floor is counted on the view ([`DeviceModel::q_guided_floor_us`]), and its plan, a group
/// per query, is made only where it is priced.
pub fn choose(
    view: &TreeView,
    shape: &AttnShape,
    base: &PlannerConfig,
    model: &DeviceModel,
) -> Result<AutoChoice> {
    let (q_guided, others): (Vec<_>, Vec<_>) = auto_candidates(base)
        .into_iter()
        .partition(|(m, _)| *m == Method::QGuided);
    let mut choices = planned(view, shape, others)?;
    let mut order: Vec<usize> = (0..choices.len()).collect();
    order.sort_by_key(|&i| choices[i].plan.num_partial_rows());
    let mut fastest = f64::INFINITY;
    for i in order {
        let c = &mut choices[i];
        if model.floor_us(&c.plan, shape) > fastest {
            continue;
        }
        c.predicted_us = model.predict_us(&c.plan, shape);
        fastest = fastest.min(c.predicted_us);
    }
    let bar = fastest * model.q_guided_margin.max(0.0).exp();
    if model.q_guided_floor_us(view, shape) <= bar {
        // Priced, it goes first, as in `Method::ALL` (ties go to the first).
        let mut q = planned(view, shape, q_guided)?;
        for c in &mut q {
            c.predicted_us = model.predict_us(&c.plan, shape);
        }
        choices.splice(0..0, q);
    }
    let pick = model
        .pick(&predictions(&choices))
        .expect("auto has candidates");
    Ok(choices.swap_remove(pick))
}

/// Every candidate of `auto` ([`auto_candidates`]) planned on `view` and priced by `model`,
/// in the candidates' order.
pub fn auto_choices(
    view: &TreeView,
    shape: &AttnShape,
    base: &PlannerConfig,
    model: &DeviceModel,
) -> Result<Vec<AutoChoice>> {
    let mut choices = planned(view, shape, auto_candidates(base))?;
    for c in &mut choices {
        c.predicted_us = model.predict_us(&c.plan, shape);
    }
    Ok(choices)
}

/// `candidates` planned on `view`, in their order, not yet priced (at infinity).
fn planned(
    view: &TreeView,
    shape: &AttnShape,
    candidates: Vec<(Method, PlannerConfig)>,
) -> Result<Vec<AutoChoice>> {
    candidates
        .into_iter()
        .map(|(method, config)| {
            Ok(AutoChoice {
                method,
                config,
                predicted_us: f64::INFINITY,
                plan: plan(view, method, shape, &config)?,
            })
        })
        .collect()
}

/// Each choice's method and predicted microseconds, for [`DeviceModel::pick`] and
/// [`DeviceModel::shortlist`].
pub fn predictions(choices: &[AutoChoice]) -> Vec<(Method, f64)> {
    choices.iter().map(|c| (c.method, c.predicted_us)).collect()
}

fn q_guided(view: &TreeView, chunk: u32) -> Vec<Group> {
    (0..view.tree.num_queries() as u32)
        .flat_map(|q| {
            split_ranges(&view.query_context(q), chunk)
                .into_iter()
                .map(move |kv| Group::unmasked(kv, vec![q]))
        })
        .collect()
}

fn deft_node(view: &TreeView, chunk: Option<u32>) -> Vec<Group> {
    let mut groups = Vec::new();
    for &n in view.tree.dfs_order() {
        let kv = view.node_kv(n);
        let queries = view.tree.queries_through(n);
        if kv.is_empty() || queries.is_empty() {
            continue;
        }
        let pieces = match chunk {
            None => vec![vec![kv]],
            Some(c) => split_ranges(&[kv], c),
        };
        groups.extend(
            pieces
                .into_iter()
                .map(|kv| Group::unmasked(kv, queries.to_vec())),
        );
    }
    groups
}

/// A run of one node's live tokens in the flattened order.
struct Segment<'t> {
    kv: Range<u32>,
    queries: &'t [u32],
}

fn deft_flatten(view: &TreeView, block: u32, query_chunk: Option<u32>) -> Vec<Group> {
    // Live tokens only: KV no query can see (pruned branches still in the cache) is skipped.
    let segments: Vec<Segment> = view
        .tree
        .dfs_order()
        .iter()
        .map(|&n| Segment {
            kv: view.node_kv(n),
            queries: view.tree.queries_through(n),
        })
        .filter(|s| !s.kv.is_empty() && !s.queries.is_empty())
        .collect();
    let mut groups = Vec::new();
    let mut start = 0usize; // index of the first segment of the current block
    let mut offset = 0u32; // tokens of segments[start] already used
    while start < segments.len() {
        // Take up to `block` tokens as (segment index, range) pieces.
        let mut pieces: Vec<(usize, Range<u32>)> = Vec::new();
        let mut room = block.max(1);
        while room > 0 && start < segments.len() {
            let s = &segments[start];
            let lo = s.kv.start + offset;
            let take = room.min(s.kv.end - lo);
            pieces.push((start, lo..lo + take));
            room -= take;
            offset += take;
            if lo + take == s.kv.end {
                start += 1;
                offset = 0;
            }
        }
        let mut queries: Vec<u32> = pieces
            .iter()
            .flat_map(|(s, _)| segments[*s].queries.iter().copied())
            .collect();
        queries.sort_unstable();
        queries.dedup();
        let chunk = query_chunk.map_or(queries.len(), |c| c.max(1) as usize);
        for qs in queries.chunks(chunk) {
            groups.extend(masked_group(&segments, &pieces, qs));
        }
    }
    groups
}

/// The group of `pieces` seen by `queries`, with a per-token mask unless all see all. Each
/// piece's visibility is found once, as mask words; the per-token mask is written only where
/// it is kept (the planners' trees are mostly pieces every query sees).
fn masked_group(
    segments: &[Segment],
    pieces: &[(usize, Range<u32>)],
    queries: &[u32],
) -> Option<Group> {
    let words = queries.len().div_ceil(64);
    let mut kv = Vec::with_capacity(pieces.len());
    let mut seen: Vec<u64> = Vec::with_capacity(pieces.len() * words);
    let mut all_visible = true;
    for (s, range) in pieces {
        let at = seen.len();
        seen.resize(at + words, 0);
        // Both lists are sorted: one walk along the two finds which queries see the piece.
        let mut sees = segments[*s].queries.iter().peekable();
        for (j, &q) in queries.iter().enumerate() {
            while sees.next_if(|&&x| x < q).is_some() {}
            if sees.peek() == Some(&&q) {
                seen[at + j / 64] |= 1 << (j % 64);
            } else {
                all_visible = false;
            }
        }
        if seen[at..].iter().all(|&b| b == 0) {
            seen.truncate(at);
            continue;
        }
        kv.push(range.clone());
    }
    if kv.is_empty() {
        return None;
    }
    let mask = (!all_visible).then(|| {
        let tokens: usize = kv.iter().map(|r: &Range<u32>| r.len()).sum();
        let mut mask = Vec::with_capacity(tokens * words);
        for (range, bits) in kv.iter().zip(seen.chunks_exact(words)) {
            for _ in range.clone() {
                mask.extend_from_slice(bits);
            }
        }
        mask
    });
    Some(Group {
        kv,
        queries: queries.to_vec(),
        mask,
    })
}

fn fasttree(view: &TreeView, shape: &AttnShape, p: &FastTreeParams) -> Vec<Group> {
    let tree = view.tree;
    let gqa = shape.group_size();
    let padded_rows = |queries: usize| (queries * gqa).div_ceil(p.tile_q) * p.tile_q;
    let padded_tokens = |t: u64| t.div_ceil(p.tile_kv as u64) * p.tile_kv as u64;
    // Cost of one group of `t` tokens and `q` queries, counting its partial rows.
    let group_cost = |t: u64, q: usize| -> f64 {
        if q == 0 || t == 0 {
            return 0.0;
        }
        let t = padded_tokens(t) as f64;
        p.alpha * padded_rows(q) as f64 * t + p.beta * t + p.gamma * (q * gqa) as f64
    };

    // Top-down (BFS order = parents first): each node receives the ranges its ancestors pushed
    // down, adds its own, and decides per child edge whether to push the total into the child.
    let mut inherited: Vec<Vec<Range<u32>>> = vec![Vec::new(); tree.nodes().len()];
    let mut is_folded = vec![false; tree.nodes().len()];
    let mut order: Vec<u32> = tree.roots().to_vec();
    let mut groups = Vec::new();
    let mut i = 0;
    while i < order.len() {
        let n = order[i];
        i += 1;
        if is_folded[n as usize] {
            continue;
        }
        let node = tree.node(n);
        order.extend(&node.children);
        let mut total = std::mem::take(&mut inherited[n as usize]);
        let own = view.node_kv(n);
        if !own.is_empty() {
            total.push(own);
        }
        let t: u64 = total.iter().map(|r| (r.end - r.start) as u64).sum();
        let through = tree.queries_through(n);
        if t == 0 || through.is_empty() {
            continue;
        }
        // Queries that stay in this node's group; children are pushed greedily, best first.
        let mut stay: Vec<u32> = through.to_vec();
        let mut children: Vec<(f64, u32)> = node
            .children
            .iter()
            .map(|&c| {
                let qc = tree.queries_through(c).len();
                let push = p.alpha * padded_rows(qc) as f64 * padded_tokens(t) as f64
                    + p.beta * padded_tokens(t) as f64;
                (push - p.gamma * (qc * gqa) as f64, c)
            })
            .filter(|(_, c)| !tree.queries_through(*c).is_empty())
            .collect();
        children.sort_by(|a, b| a.0.total_cmp(&b.0));
        for (_, c) in children {
            let qc = tree.queries_through(c);
            let remaining: Vec<u32> = stay
                .iter()
                .copied()
                .filter(|q| qc.binary_search(q).is_err())
                .collect();
            let before = group_cost(t, stay.len());
            let after = group_cost(t, remaining.len())
                + p.alpha * padded_rows(qc.len()) as f64 * padded_tokens(t) as f64
                + p.beta * padded_tokens(t) as f64
                - p.gamma * (qc.len() * gqa) as f64;
            if after < before {
                inherited[c as usize] = total.clone();
                stay = remaining;
            }
        }
        // Short leaves kept here (not pushed) join this group, their tokens under a mask:
        // a leaf shorter than a CTA's fixed work costs less as this group's tokens than as
        // CTAs of its own, and its queries need no partial row of their own (where every
        // query then has one, the merge is skipped). Only while the group stays one CTA's
        // rows (a group split by query would read the leaves in every piece), and to no more
        // tokens than the group's own, so that its CTAs' chain at most doubles. FastTree's
        // tree 9 (16-token leaves) went from 90.7 to 69.3 µs at 32/8 and from 211.5 to
        // 174.1 at 32/32; folding 32-token leaves made trees 0, 2 and 5 slower by 5-19%
        // (docs/BENCHMARKS.md, session 12).
        let mut folded = Vec::new();
        let mut room = t;
        if stay.len() * gqa <= CTA_ROWS {
            for &c in &node.children {
                let leaf = view.node_kv(c).len() as u64;
                if tree.node(c).children.is_empty()
                    && inherited[c as usize].is_empty()
                    && leaf > 0
                    && leaf < CTA_FIXED_WORK
                    && leaf <= room
                    && !tree.queries_through(c).is_empty()
                {
                    is_folded[c as usize] = true;
                    folded.push(c);
                    room -= leaf;
                }
            }
        }
        if !stay.is_empty() {
            // The group's own ranges, seen by all of its queries, then each folded leaf's.
            let mut segments: Vec<Segment> = total
                .iter()
                .map(|r| Segment {
                    kv: r.clone(),
                    queries: &stay,
                })
                .collect();
            segments.extend(folded.iter().map(|&c| Segment {
                kv: view.node_kv(c),
                queries: tree.queries_through(c),
            }));
            let whole: Vec<(usize, Range<u32>)> = segments
                .iter()
                .enumerate()
                .map(|(i, s)| (i, s.kv.clone()))
                .collect();
            groups.extend(masked_group(&segments, &whole, &stay));
        }
    }
    groups
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shard::{shard_tree, Shard};
    use crate::tree::{fan, TreeBuilder};

    fn fork() -> crate::tree::KvTree {
        let mut b = TreeBuilder::new();
        let root = b.add_root(300);
        for _ in 0..4 {
            let c = b.add_child(root, 20).unwrap();
            b.add_query(c).unwrap();
        }
        b.build().unwrap()
    }

    #[test]
    fn every_method_covers_every_context_on_every_shard() {
        let t = fork();
        let shape = AttnShape::new(8, 2, 64).unwrap();
        for ranks in 1..=3 {
            for shard in shard_tree(&t, ranks).unwrap() {
                let view = TreeView::new(&t, &shard);
                for m in Method::ALL.into_iter().chain([Method::Auto]) {
                    let plan = plan(&view, m, &shape, &PlannerConfig::default()).unwrap();
                    plan.check_coverage(|q| view.query_context(q))
                        .unwrap_or_else(|e| panic!("{m} p={ranks}: {e}"));
                }
            }
        }
    }

    #[test]
    fn shared_prefix_is_read_once_by_deft_and_per_query_by_q_guided() {
        let t = fork();
        let shape = AttnShape::new(8, 2, 64).unwrap();
        let shard = Shard::whole(&t);
        let view = TreeView::new(&t, &shard);
        let io = |m| {
            plan(&view, m, &shape, &PlannerConfig::default())
                .unwrap()
                .io(&shape, crate::DType::F16)
        };
        assert_eq!(io(Method::DeftFlatten).kv_tokens_read, 380);
        assert_eq!(io(Method::DeftNode).kv_tokens_read, 380);
        assert_eq!(io(Method::QGuided).kv_tokens_read, 4 * 320);
    }

    #[test]
    fn flatten_masks_only_mixed_blocks() {
        let t = fork();
        let shape = AttnShape::new(8, 2, 64).unwrap();
        let shard = Shard::whole(&t);
        let view = TreeView::new(&t, &shard);
        let p = plan(
            &view,
            Method::DeftFlatten,
            &shape,
            &PlannerConfig::default(),
        )
        .unwrap();
        // Blocks 0 and 1 are pure root tokens (all queries, no mask); block 2 mixes the root tail
        // with the four children.
        assert!(p.groups()[0].mask.is_none());
        assert!(p.groups()[2].mask.is_some());
        assert_eq!(p.groups().len(), 3);
    }

    /// FastTree's tree 9 in small: 16-token leaves under a 128-token node join its group
    /// under a mask, so every query has one partial row (no merge); 32-token leaves do not.
    #[test]
    fn fasttree_folds_short_leaves_into_their_parent() {
        let shape = AttnShape::new(32, 8, 128).unwrap();
        for (leaf, folded) in [(16, true), (32, false)] {
            let t = fan(128, 8, leaf);
            let shard = Shard::whole(&t);
            let view = TreeView::new(&t, &shard);
            let p = plan(&view, Method::FastTree, &shape, &PlannerConfig::default()).unwrap();
            p.check_coverage(|q| view.query_context(q)).unwrap();
            assert_eq!(p.groups().len() == 1, folded, "{leaf}-token leaves: {p:?}");
            assert_eq!(p.rows_are_queries(), folded);
            if folded {
                let g = &p.groups()[0];
                assert!(g.mask.is_some());
                assert_eq!(g.tokens(), 128 + 8 * leaf);
            }
        }
    }

    #[test]
    fn fasttree_splits_a_lone_long_sequence() {
        let mut b = TreeBuilder::new();
        let r = b.add_root(100_000);
        b.add_query(r).unwrap();
        let t = b.build().unwrap();
        let shape = AttnShape::new(16, 16, 128).unwrap();
        let shard = Shard::whole(&t);
        let view = TreeView::new(&t, &shard);
        let p = plan(&view, Method::FastTree, &shape, &PlannerConfig::default()).unwrap();
        assert!(p.groups().len() * 16 >= 264, "{} groups", p.groups().len());
        p.check_coverage(|q| view.query_context(q)).unwrap();
    }

    #[test]
    fn auto_shares_a_long_prefix_and_keeps_a_lone_sequence_whole() {
        let shape = AttnShape::new(32, 8, 128).unwrap();
        let model = DeviceModel::default();
        let t = fan(4000, 50, 10);
        let shard = Shard::whole(&t);
        let view = TreeView::new(&t, &shard);
        let pick = choose(&view, &shape, &PlannerConfig::default(), &model).unwrap();
        assert_ne!(pick.method, Method::QGuided, "{pick:?}");
        let q = plan(&view, Method::QGuided, &shape, &PlannerConfig::default()).unwrap();
        assert!(pick.predicted_us < model.predict_us(&q, &shape));
        assert!(pick.plan.io(&shape, crate::DType::F16).kv_tokens_read < 2 * 4500);
    }

    #[test]
    fn method_names_round_trip() {
        for m in Method::ALL {
            assert_eq!(m.name().parse::<Method>().unwrap(), m);
        }
        assert_eq!(Method::parse_list("all").unwrap().len(), 6);
        assert_eq!("auto".parse::<Method>().unwrap(), Method::Auto);
        assert!("radix".parse::<Method>().is_err());
    }
}
