//! A generation's KV bookkeeping on the KV-cache manager: the prompt as one root, placed in
//! contiguous chunks over the ranks (rank `r`'s chunk is the one it prefills), and each
//! sample as a branch of it whose tokens go, page by page, to the rank with the fewest pages
//! (so decode's attention work stays balanced). Every rank keeps the same bookkeeping, so
//! all agree where each token lives without talking.

use crate::Result;
use canopy_core::{KvTree, Tail};
use canopy_kv::{KvManager, KvNode, Placement, RankSnapshot, RankUpdate, StepLayout};
use std::ops::Range;

/// One rank's part of a step, as its planner and its storage see it.
pub struct RankView {
    /// Every node, each as long as this rank's share, one query per live sample in order.
    pub tree: KvTree,
    /// Logical page → physical page of this rank's pool.
    pub table: Vec<u32>,
    /// Logical tokens the page table maps (what a ring hop sends).
    pub tokens: usize,
}

/// What changed for one rank in a step.
pub enum RankChange {
    /// The rank's layout moved: plan this view afresh.
    Fresh(RankView),
    /// Only appends inside its pages: extend the plan by these tails.
    Grown(Vec<Tail>),
}

impl RankView {
    fn of(snap: &RankSnapshot, page_size: u32) -> RankView {
        let ps = page_size as usize;
        RankView {
            tokens: snap.table.len() * ps,
            tree: snap.tree.clone(),
            table: snap.table.clone(),
        }
    }
}

/// Where every token of one generation's KV lives.
pub struct KvLayout {
    manager: KvManager,
    steps: StepLayout,
    root: KvNode,
    samples: Vec<Option<KvNode>>,
    pages_per_rank: u32,
}

impl KvLayout {
    /// Room for a prompt of `prompt` tokens and `samples` samples of up to `max_tokens`
    /// tokens each, over `ranks` ranks.
    pub fn new(
        ranks: usize,
        page_size: u32,
        prompt: usize,
        samples: usize,
        max_tokens: usize,
    ) -> Result<KvLayout> {
        let pages = |tokens: usize| tokens.div_ceil(page_size as usize);
        // The prompt's chunk, every sample's growth if one rank took it all, and a partial
        // page per sample.
        let pages_per_rank =
            (pages(prompt).div_ceil(ranks) + samples * (pages(max_tokens) + 1)) as u32;
        let mut manager = KvManager::new(ranks, page_size, pages_per_rank)?;
        let root = manager.add_root(prompt as u32, Placement::Contiguous)?;
        Ok(KvLayout {
            manager,
            steps: StepLayout::new(),
            root,
            samples: vec![None; samples],
            pages_per_rank,
        })
    }

    /// Tokens each rank's storage holds (its whole pool).
    pub fn pool_tokens(&self) -> usize {
        (self.pages_per_rank * self.manager.page_size()) as usize
    }

    /// The prompt positions rank `rank` prefills (empty when the prompt has fewer pages than
    /// there are ranks).
    pub fn prompt_chunk(&self, rank: usize) -> Range<usize> {
        let runs = self.manager.runs(self.root).unwrap_or_default();
        runs.into_iter()
            .find(|(r, _)| *r == rank)
            .map_or(0..0, |(_, t)| t.start as usize..t.end as usize)
    }

    /// Where rank `rank`'s prompt chunk is stored: `(row of the chunk, physical slot)`, in
    /// token order.
    pub fn prompt_slots(&self, rank: usize) -> Vec<(u32, u32)> {
        self.prompt_chunk(rank)
            .enumerate()
            .map(|(row, i)| (row as u32, self.slot(self.root, i as u32).1))
            .collect()
    }

    /// The rank and physical slot of token `i` of `node`.
    fn slot(&self, node: KvNode, i: u32) -> (usize, u32) {
        let ps = self.manager.page_size();
        let pages = self.manager.pages(node).expect("a node of this layout");
        let p = pages[(i / ps) as usize];
        (p.rank, p.page * ps + i % ps)
    }

    /// Places one new token for each of the `live` samples (a branch on its first token) and
    /// marks exactly those live; returns each one's rank and physical slot.
    pub fn append(&mut self, live: &[usize]) -> Result<Vec<(usize, u32)>> {
        for (s, node) in self.samples.iter().enumerate() {
            if let Some(n) = node {
                self.manager.set_live(*n, live.contains(&s))?;
            }
        }
        live.iter()
            .map(|&s| {
                let node = match self.samples[s] {
                    Some(n) => {
                        self.manager.append(n, 1, Placement::Balanced)?;
                        n
                    }
                    None => {
                        let n = self.manager.fork(self.root, 1, Placement::Balanced)?;
                        self.samples[s] = Some(n);
                        n
                    }
                };
                self.manager.set_live(node, true)?;
                Ok(self.slot(node, self.manager.len(node)? - 1))
            })
            .collect()
    }

    /// What changed for each rank with this step's appends (the first step is fresh on
    /// every rank): queries in sample order, which is `live`'s.
    pub fn update(&mut self) -> Result<Vec<RankChange>> {
        let ps = self.manager.page_size();
        Ok(self
            .steps
            .update(&self.manager)?
            .into_iter()
            .map(|u| match u {
                RankUpdate::Fresh(snap) => RankChange::Fresh(RankView::of(snap, ps)),
                RankUpdate::Grown(tails) => RankChange::Grown(tails),
            })
            .collect())
    }

    /// Every rank's view as of the last [`update`](Self::update).
    pub fn views(&self) -> Vec<RankView> {
        let ps = self.manager.page_size();
        (0..self.manager.ranks())
            .filter_map(|r| self.steps.rank(r).map(|s| RankView::of(s, ps)))
            .collect()
    }
}
