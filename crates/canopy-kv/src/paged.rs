//! A paged KV cache over ranks, for trees that grow while they decode.
//!
//! Physical KV lives in fixed-size pages; each rank has a pool of its own. A node's tokens are
//! held in a sequence of pages, page `i` holding the node's tokens `i·page_size ..`, and every
//! page belongs to one rank: a long node can be spread over the ranks (sequence sharding), a
//! short one sits on one. A node's context's other tokens are its ancestors' pages, which every
//! descendant shares: forking a branch allocates pages for the branch's new tokens only, and
//! no shared prefix is ever copied. Appending fills a leaf's last page (wherever it is) before
//! taking new ones, which a [`Placement`] puts on ranks; pruning a subtree returns its pages to
//! their pools.
//!
//! [`KvManager::snapshot`] gives one rank's view to the planners: an ordinary [`KvTree`] with
//! the whole tree's topology and query order, each node as long as the tokens this rank holds
//! of it (none: an empty node), starting on page boundaries of the rank's logical address
//! space, plus the page table from the rank's logical pages to its pool's physical pages that
//! the kernels read through. The ranks hold disjoint tokens and attention over disjoint tokens
//! merges exactly, so each rank plans and runs its own tree and the ranks' partial states merge
//! into the whole tree's attention. Only a node's last page is partly filled, so a rank's
//! tokens of a node are whole pages and at most one partial page at their end.
//!
//! Most decode steps change no layout: every live leaf appends a token inside its last page,
//! so no node moves and no page is taken. [`KvManager::catch_up`] recognises such steps rank by
//! rank and brings that rank's snapshot up to date in place, returning each node that grew
//! there as a [`Tail`] (old end, new end); a plan follows with
//! [`canopy_core::Plan::extend_tails`] instead of being rebuilt. A page taken on the rank, or
//! any change of topology (a fork, a prune, a query set), means a new snapshot is due; a page
//! taken on another rank changes nothing here.

use crate::error::{KvError, Result};
use crate::placement::Placement;
use canopy_core::{KvTree, NodeId, Tail, TreeBuilder};
use std::ops::Range;

/// A handle to a node of a [`KvManager`]; stable while the node lives.
pub type KvNode = u32;

/// One page of one rank's pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PageRef {
    pub rank: usize,
    /// The page's index in the rank's pool.
    pub page: u32,
}

#[derive(Debug, Clone)]
struct Slot {
    parent: Option<KvNode>,
    children: Vec<KvNode>,
    len: u32,
    /// The node's pages in token order.
    pages: Vec<PageRef>,
    /// Tokens of the node each rank holds: what a rank's snapshot lays out.
    held: Vec<u32>,
    /// Whether a decode query sits on this node.
    live: bool,
}

#[derive(Debug, Clone)]
struct Pool {
    pages: u32,
    free: Vec<u32>,
    /// Moves whenever a page is taken from this pool.
    taken: u64,
}

impl Pool {
    fn in_use(&self) -> usize {
        self.pages as usize - self.free.len()
    }
}

/// A tree of token runs in the KV page pools of `ranks` ranks.
#[derive(Debug, Clone)]
pub struct KvManager {
    page_size: u32,
    pools: Vec<Pool>,
    slots: Vec<Option<Slot>>,
    roots: Vec<KvNode>,
    /// Moves whenever every rank's layout would change: nodes added, pruned or marked live.
    /// Appends move only the taking rank's [`Pool::taken`], and none inside a last page.
    topology: u64,
}

/// One rank's part of a [`KvManager`] as its planners and kernels see it at one moment.
#[derive(Debug, Clone, PartialEq)]
pub struct RankSnapshot {
    pub rank: usize,
    /// Every node of the cache, in the same order and with the same queries on every rank,
    /// each as long as the tokens this rank holds of it, on page boundaries.
    pub tree: KvTree,
    /// This rank's logical page → physical page of its pool.
    pub table: Vec<u32>,
    /// The cache's topology and this rank's pages taken, when taken or last caught up.
    version: (u64, u64),
    /// For each cache node: its node in `tree` and the length `tree` has for it.
    nodes: Vec<Option<(NodeId, u32)>>,
}

impl RankSnapshot {
    /// The node of [`tree`](Self::tree) that holds cache node `node`'s tokens on this rank
    /// (`None`: `node` did not exist when the snapshot was taken).
    pub fn node(&self, node: KvNode) -> Option<NodeId> {
        self.nodes.get(node as usize)?.map(|(id, _)| id)
    }
}

impl KvManager {
    /// An empty cache over `ranks` pools of `pages_per_rank` pages of `page_size` tokens.
    pub fn new(ranks: usize, page_size: u32, pages_per_rank: u32) -> Result<KvManager> {
        if ranks == 0 || page_size == 0 {
            return Err(KvError::Config { ranks, page_size });
        }
        let pool = Pool {
            pages: pages_per_rank,
            free: (0..pages_per_rank).rev().collect(),
            taken: 0,
        };
        Ok(KvManager {
            page_size,
            pools: vec![pool; ranks],
            slots: Vec::new(),
            roots: Vec::new(),
            topology: 0,
        })
    }

    pub fn ranks(&self) -> usize {
        self.pools.len()
    }

    pub fn page_size(&self) -> u32 {
        self.page_size
    }

    /// Pages in use on all ranks (shared prefixes counted once).
    pub fn pages_in_use(&self) -> usize {
        self.pools.iter().map(Pool::in_use).sum()
    }

    /// Pages in use on `rank`.
    pub fn pages_in_use_on(&self, rank: usize) -> Result<usize> {
        Ok(self.pool(rank)?.in_use())
    }

    fn pool(&self, rank: usize) -> Result<&Pool> {
        self.pools.get(rank).ok_or(KvError::NoRank {
            rank,
            ranks: self.pools.len(),
        })
    }

    fn slot(&self, n: KvNode) -> Result<&Slot> {
        self.slots
            .get(n as usize)
            .and_then(Option::as_ref)
            .ok_or(KvError::NoNode(n))
    }

    fn slot_mut(&mut self, n: KvNode) -> Result<&mut Slot> {
        self.slots
            .get_mut(n as usize)
            .and_then(Option::as_mut)
            .ok_or(KvError::NoNode(n))
    }

    fn insert(
        &mut self,
        parent: Option<KvNode>,
        tokens: u32,
        placement: Placement,
    ) -> Result<KvNode> {
        if tokens == 0 {
            return Err(KvError::EmptyNode);
        }
        let id = self.slots.len() as KvNode;
        self.slots.push(Some(Slot {
            parent,
            children: Vec::new(),
            len: 0,
            pages: Vec::new(),
            held: vec![0; self.pools.len()],
            live: false,
        }));
        if let Err(e) = self.append_unchecked(id, tokens, placement) {
            self.slots.pop();
            return Err(e);
        }
        match parent {
            Some(p) => self.slot_mut(p)?.children.push(id),
            None => self.roots.push(id),
        }
        self.topology += 1;
        Ok(id)
    }

    /// A new sequence (prompt) of `tokens` tokens.
    pub fn add_root(&mut self, tokens: u32, placement: Placement) -> Result<KvNode> {
        self.insert(None, tokens, placement)
    }

    /// A new branch of `tokens` tokens under `parent`, sharing all of `parent`'s pages.
    pub fn fork(&mut self, parent: KvNode, tokens: u32, placement: Placement) -> Result<KvNode> {
        self.slot(parent)?;
        self.insert(Some(parent), tokens, placement)
    }

    /// Appends `tokens` tokens to leaf `node` (a decode step's new KV).
    pub fn append(&mut self, node: KvNode, tokens: u32, placement: Placement) -> Result<()> {
        if !self.slot(node)?.children.is_empty() {
            return Err(KvError::NotALeaf(node));
        }
        self.append_unchecked(node, tokens, placement)
    }

    /// Fills `node`'s last page, then places the pages the rest needs; takes nothing when a
    /// pool lacks room.
    fn append_unchecked(&mut self, node: KvNode, tokens: u32, placement: Placement) -> Result<()> {
        let page = self.page_size;
        let s = self.slot(node)?;
        let fill = (s.pages.len() as u32 * page - s.len).min(tokens);
        let last_rank = s.pages.last().map(|p| p.rank);
        let rest = tokens - fill;
        let in_use: Vec<usize> = self.pools.iter().map(Pool::in_use).collect();
        let ranks = placement.ranks(rest.div_ceil(page) as usize, &in_use);
        for (rank, pool) in self.pools.iter().enumerate() {
            let need = ranks.iter().filter(|&&r| r == rank).count();
            if need > pool.free.len() {
                return Err(KvError::PoolFull {
                    rank,
                    need,
                    free: pool.free.len(),
                    pages: pool.pages,
                });
            }
        }
        let fresh: Vec<PageRef> = ranks
            .into_iter()
            .map(|rank| {
                let pool = &mut self.pools[rank];
                pool.taken += 1;
                let page = pool.free.pop().expect("room checked above");
                PageRef { rank, page }
            })
            .collect();
        let s = self.slot_mut(node)?;
        if let Some(rank) = last_rank {
            s.held[rank] += fill;
        }
        for (i, p) in fresh.iter().enumerate() {
            s.held[p.rank] += page.min(rest - i as u32 * page);
        }
        s.pages.extend(fresh);
        s.len += tokens;
        Ok(())
    }

    /// Marks whether a decode query sits on `node`.
    pub fn set_live(&mut self, node: KvNode, live: bool) -> Result<()> {
        let slot = self.slot_mut(node)?;
        if slot.live != live {
            slot.live = live;
            self.topology += 1;
        }
        Ok(())
    }

    /// Removes `node` and its subtree, returning their pages to their pools; returns the
    /// number of pages freed. Ancestors' (shared) pages are untouched.
    pub fn prune(&mut self, node: KvNode) -> Result<usize> {
        let parent = self.slot(node)?.parent;
        self.topology += 1;
        match parent {
            Some(p) => self.slot_mut(p)?.children.retain(|&c| c != node),
            None => self.roots.retain(|&r| r != node),
        }
        let mut freed = 0;
        let mut stack = vec![node];
        while let Some(n) = stack.pop() {
            let s = self.slots[n as usize].take().expect("live subtree node");
            freed += s.pages.len();
            for p in s.pages {
                self.pools[p.rank].free.push(p.page);
            }
            stack.extend(s.children);
        }
        Ok(freed)
    }

    /// Splits `node` after its first `pages` pages: a new node takes those pages and
    /// `node`'s place under its parent, and `node` becomes its only child with the rest, so
    /// that a prefix of `node` can be shared by other branches (a prefix cache splits where
    /// a new request's match ends). Handles to `node` and its subtree stay valid; returns the
    /// new node.
    pub fn split(&mut self, node: KvNode, pages: u32) -> Result<KvNode> {
        let page = self.page_size;
        let s = self.slot(node)?;
        if pages == 0 || pages as usize >= s.pages.len() || pages * page >= s.len {
            return Err(KvError::BadSplit {
                node,
                pages,
                len: s.len,
            });
        }
        let parent = s.parent;
        let head_pages = s.pages[..pages as usize].to_vec();
        let mut head_held = vec![0; self.pools.len()];
        for p in &head_pages {
            head_held[p.rank] += page;
        }
        let id = self.slots.len() as KvNode;
        self.slots.push(Some(Slot {
            parent,
            children: vec![node],
            len: pages * page,
            pages: head_pages,
            held: head_held.clone(),
            live: false,
        }));
        let s = self.slot_mut(node)?;
        s.parent = Some(id);
        s.pages.drain(..pages as usize);
        s.len -= pages * page;
        for (held, head) in s.held.iter_mut().zip(&head_held) {
            *held -= head;
        }
        let siblings = match parent {
            Some(p) => &mut self.slot_mut(p)?.children,
            None => &mut self.roots,
        };
        let at = siblings
            .iter()
            .position(|&c| c == node)
            .expect("a node is among its parent's children");
        siblings[at] = id;
        self.topology += 1;
        Ok(id)
    }

    /// Pages free on all ranks.
    pub fn pages_free(&self) -> usize {
        self.pools.iter().map(|p| p.free.len()).sum()
    }

    /// Pages of all ranks' pools.
    pub fn pages_total(&self) -> usize {
        self.pools.iter().map(|p| p.pages as usize).sum()
    }

    /// New pages that `tokens` more tokens on leaf `node` take (its last page fills first).
    pub fn pages_to_append(&self, node: KvNode, tokens: u32) -> Result<usize> {
        let s = self.slot(node)?;
        let room = s.pages.len() as u32 * self.page_size - s.len;
        Ok(tokens.saturating_sub(room).div_ceil(self.page_size) as usize)
    }

    /// Whether `node` has no children.
    pub fn is_leaf(&self, node: KvNode) -> Result<bool> {
        Ok(self.slot(node)?.children.is_empty())
    }

    /// Live leaves and other nodes with a query, in node order: the query order of every
    /// rank's snapshot.
    pub fn live(&self) -> Vec<KvNode> {
        (0..self.slots.len() as KvNode)
            .filter(|&n| self.slots[n as usize].as_ref().is_some_and(|s| s.live))
            .collect()
    }

    /// The node `node` was forked from (`None` for a root).
    pub fn parent(&self, node: KvNode) -> Result<Option<KvNode>> {
        Ok(self.slot(node)?.parent)
    }

    /// The node's own tokens (not its ancestors').
    pub fn len(&self, node: KvNode) -> Result<u32> {
        Ok(self.slot(node)?.len)
    }

    /// The node's pages in token order: page `i` holds tokens `i·page_size ..` of the node.
    pub fn pages(&self, node: KvNode) -> Result<&[PageRef]> {
        Ok(&self.slot(node)?.pages)
    }

    /// Tokens of the node each rank holds, indexed by rank.
    pub fn held(&self, node: KvNode) -> Result<&[u32]> {
        Ok(&self.slot(node)?.held)
    }

    /// The node's tokens as maximal runs held by one rank, in token order: `(rank, tokens)`.
    /// For a prompt placed [`Placement::Contiguous`], run `r` is the chunk rank `r` prefills.
    pub fn runs(&self, node: KvNode) -> Result<Vec<(usize, Range<u32>)>> {
        let s = self.slot(node)?;
        let mut runs: Vec<(usize, Range<u32>)> = Vec::new();
        for (i, p) in s.pages.iter().enumerate() {
            let start = i as u32 * self.page_size;
            let end = (start + self.page_size).min(s.len);
            match runs.last_mut() {
                Some((rank, r)) if *rank == p.rank => r.end = end,
                _ => runs.push((p.rank, start..end)),
            }
        }
        Ok(runs)
    }

    /// Every rank's [`snapshot`](Self::snapshot), in rank order.
    pub fn snapshots(&self) -> Result<Vec<RankSnapshot>> {
        (0..self.ranks()).map(|r| self.snapshot(r)).collect()
    }

    /// `rank`'s part of the tree as its planners see it: every node, with one query per live
    /// node (in the order of [`live`](Self::live)), each as long as the tokens `rank` holds of
    /// it and starting on a page boundary, and the rank's page table.
    pub fn snapshot(&self, rank: usize) -> Result<RankSnapshot> {
        self.snapshot_with(rank, &self.live())
    }

    /// `rank`'s part of the tree with one query on each of `queries`, in that order (a node
    /// may carry several: the rows of a prompt chunk, each seeing all of the node's tokens),
    /// whatever is marked live. Such a snapshot is for one pass; [`catch_up`](Self::catch_up)
    /// follows only snapshots of the live queries.
    pub fn snapshot_with(&self, rank: usize, queries: &[KvNode]) -> Result<RankSnapshot> {
        let pool = self.pool(rank)?;
        for &n in queries {
            self.slot(n)?;
        }
        let mut b = TreeBuilder::new()
            .with_alignment(self.page_size)
            .with_empty_nodes();
        let mut ids = vec![None; self.slots.len()];
        // Parents before children: walk from the roots.
        let mut stack: Vec<KvNode> = self.roots.iter().rev().copied().collect();
        let mut order = Vec::new();
        while let Some(n) = stack.pop() {
            let s = self.slot(n)?;
            ids[n as usize] = Some(match s.parent {
                None => b.add_root(s.held[rank]),
                Some(p) => b.add_child(ids[p as usize].expect("parent first"), s.held[rank])?,
            });
            order.push(n);
            stack.extend(s.children.iter().rev());
        }
        for &n in queries {
            b.add_query(ids[n as usize].expect("every node is in the tree"))?;
        }
        let tree = b.build()?;
        let mut table = vec![0u32; tree.total_tokens().div_ceil(self.page_size) as usize];
        let mut nodes = vec![None; self.slots.len()];
        for n in order {
            let id = ids[n as usize].expect("placed");
            let node = tree.node(id);
            let first = (node.kv.start / self.page_size) as usize;
            let here = self.slot(n)?.pages.iter().filter(|p| p.rank == rank);
            for (i, p) in here.enumerate() {
                table[first + i] = p.page;
            }
            nodes[n as usize] = Some((id, node.len()));
        }
        Ok(RankSnapshot {
            rank,
            tree,
            table,
            version: (self.topology, pool.taken),
            nodes,
        })
    }

    /// Brings `snap` up to date when nothing but appends inside pages this rank already had
    /// happened since it was taken (or last caught up), and returns the nodes that grew on
    /// its rank, in its logical addresses. `None`: the layout moved; take a new
    /// [`snapshot`](Self::snapshot) of the rank.
    pub fn catch_up(&self, snap: &mut RankSnapshot) -> Option<Vec<Tail>> {
        let pool = self.pools.get(snap.rank)?;
        if snap.version != (self.topology, pool.taken) {
            return None;
        }
        let mut tails = Vec::new();
        for (slot, node) in self.slots.iter().zip(&mut snap.nodes) {
            let (Some(slot), Some((id, len))) = (slot, node.as_mut()) else {
                continue;
            };
            let held = slot.held[snap.rank];
            if held != *len {
                let start = snap.tree.node(*id).kv.start;
                let tail = Tail {
                    end: start + *len,
                    new_end: start + held,
                };
                snap.tree.extend_node(*id, tail.new_end);
                *len = held;
                tails.push(tail);
            }
        }
        Some(tails)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use canopy_core::{plan, AttnShape, Method, PlannerConfig, Shard, TreeView};
    use proptest::prelude::*;

    const BALANCED: Placement = Placement::Balanced;
    const CONTIGUOUS: Placement = Placement::Contiguous;

    #[test]
    fn forks_share_the_prefix_pages_and_prunes_free_their_own() {
        let mut t = KvManager::new(1, 16, 64).unwrap();
        let root = t.add_root(40, BALANCED).unwrap(); // 3 pages
        let a = t.fork(root, 5, BALANCED).unwrap(); // 1 page
        let b = t.fork(root, 20, BALANCED).unwrap(); // 2 pages
        t.set_live(a, true).unwrap();
        t.set_live(b, true).unwrap();
        assert_eq!(t.pages_in_use(), 6);
        t.append(a, 11, BALANCED).unwrap(); // fills a's page exactly
        assert_eq!(t.pages_in_use(), 6);
        t.append(a, 1, BALANCED).unwrap();
        assert_eq!(t.pages_in_use(), 7);
        assert!(
            t.append(root, 1, BALANCED).is_err(),
            "internal nodes do not grow"
        );
        let RankSnapshot { tree, table, .. } = t.snapshot(0).unwrap();
        assert_eq!(tree.num_queries(), 2);
        // Both queries' contexts start with the root's three pages: the same physical pages.
        let root_pages: Vec<u32> = table[..3].to_vec();
        let ctx = |q: u32| {
            let mut pages = Vec::new();
            let mut n = Some(tree.query_node(q));
            while let Some(id) = n {
                let node = tree.node(id);
                pages.extend(
                    node.kv
                        .clone()
                        .step_by(16)
                        .map(|a| table[(a / 16) as usize]),
                );
                n = node.parent;
            }
            pages
        };
        for q in 0..2 {
            let pages = ctx(q);
            assert!(root_pages.iter().all(|p| pages.contains(p)), "{pages:?}");
        }
        assert_eq!(t.prune(b).unwrap(), 2);
        assert_eq!(t.pages_in_use(), 5);
        assert!(t.fork(b, 1, BALANCED).is_err(), "pruned nodes are gone");
    }

    #[test]
    fn a_full_pool_is_an_error_not_a_panic() {
        let mut t = KvManager::new(1, 8, 2).unwrap();
        let r = t.add_root(16, BALANCED).unwrap();
        let e = t.fork(r, 1, BALANCED).unwrap_err().to_string();
        assert!(e.contains("pool is full"), "{e}");
        assert_eq!(t.pages_in_use(), 2);
    }

    /// Appends inside the last page keep the layout: `catch_up` extends the snapshot in place
    /// and reports the tails; a page taken, a fork or a prune needs a new snapshot.
    #[test]
    fn appends_inside_a_page_are_caught_up_and_new_pages_are_not() {
        let mut t = KvManager::new(1, 16, 64).unwrap();
        let root = t.add_root(40, BALANCED).unwrap();
        let a = t.fork(root, 5, BALANCED).unwrap();
        t.set_live(a, true).unwrap();
        let mut snap = t.snapshot(0).unwrap();
        let a_kv = snap.tree.node(1).kv.clone();
        assert_eq!(t.catch_up(&mut snap), Some(vec![]));
        t.append(a, 3, BALANCED).unwrap();
        let tails = t.catch_up(&mut snap).unwrap();
        assert_eq!(
            tails,
            vec![Tail {
                end: a_kv.end,
                new_end: a_kv.end + 3
            }]
        );
        assert_eq!(snap.tree.node(1).kv, a_kv.start..a_kv.end + 3);
        assert_eq!(snap.tree.total_tokens(), a_kv.end + 3);
        t.append(a, 8, BALANCED).unwrap(); // 16 tokens: the page is full, not exceeded
        assert_eq!(t.catch_up(&mut snap).unwrap().len(), 1);
        t.append(a, 1, BALANCED).unwrap(); // a second page
        assert_eq!(t.catch_up(&mut snap), None);
        let mut snap = t.snapshot(0).unwrap();
        t.fork(root, 1, BALANCED).unwrap();
        assert_eq!(t.catch_up(&mut snap), None);
    }

    /// Decode growth goes where the fewest pages are, ties to the lowest rank; a leaf's last
    /// page fills before a new one is taken, wherever that page is.
    #[test]
    fn balanced_growth_takes_the_emptiest_rank() {
        let mut t = KvManager::new(3, 4, 16).unwrap();
        let root = t.add_root(10, CONTIGUOUS).unwrap(); // 3 pages: one per rank
        assert_eq!(t.held(root).unwrap(), [4, 4, 2]);
        let a = t.fork(root, 4, BALANCED).unwrap(); // all tie at one page: rank 0
        let b = t.fork(root, 4, BALANCED).unwrap(); // ranks 1 and 2 tie: rank 1
        assert_eq!(t.pages(a).unwrap()[0].rank, 0);
        assert_eq!(t.pages(b).unwrap()[0].rank, 1);
        t.append(b, 9, BALANCED).unwrap(); // ranks 2, 0, 1: one page each, 1 token in the last
        let ranks: Vec<usize> = t.pages(b).unwrap().iter().map(|p| p.rank).collect();
        assert_eq!(ranks, [1, 2, 0, 1]);
        assert_eq!(t.held(b).unwrap(), [4, 5, 4]);
        t.append(b, 3, BALANCED).unwrap(); // fills b's last page on rank 1, takes none
        assert_eq!(t.pages(b).unwrap().len(), 4);
        assert_eq!(t.held(b).unwrap(), [4, 8, 4]);
        assert_eq!(
            (0..3)
                .map(|r| t.pages_in_use_on(r).unwrap())
                .collect::<Vec<_>>(),
            [3, 3, 2]
        );
    }

    /// A prompt placed contiguously is one block of pages per rank, in rank order: the chunks
    /// of a sequence-parallel prefill.
    #[test]
    fn a_contiguous_prompt_is_one_block_per_rank() {
        let mut t = KvManager::new(4, 16, 64).unwrap();
        let prompt = t.add_root(16 * 10 - 3, CONTIGUOUS).unwrap(); // 10 pages: 2, 3, 2, 3
        let runs = t.runs(prompt).unwrap();
        assert_eq!(runs, [(0, 0..32), (1, 32..80), (2, 80..112), (3, 112..157)]);
        assert_eq!(t.held(prompt).unwrap(), [32, 48, 32, 45]);
        // A continuation of the prompt fills its last page (rank 3) first, then is split again.
        t.append(prompt, 3 + 64, CONTIGUOUS).unwrap();
        let runs = t.runs(prompt).unwrap();
        assert_eq!(
            runs[3..],
            [
                (3, 112..160),
                (0, 160..176),
                (1, 176..192),
                (2, 192..208),
                (3, 208..224)
            ]
        );
    }

    /// A fork spread over ranks shares its root's pages on every rank: each rank's tree holds
    /// the root's tokens it owns once, in the context of both leaves.
    #[test]
    fn forks_share_pages_across_ranks() {
        let mut t = KvManager::new(2, 8, 16).unwrap();
        let root = t.add_root(32, CONTIGUOUS).unwrap();
        let a = t.fork(root, 3, BALANCED).unwrap();
        let b = t.fork(root, 12, CONTIGUOUS).unwrap();
        t.set_live(a, true).unwrap();
        t.set_live(b, true).unwrap();
        assert_eq!(t.pages_in_use_on(0).unwrap(), 4);
        assert_eq!(t.pages_in_use_on(1).unwrap(), 3);
        for rank in 0..2 {
            let s = t.snapshot(rank).unwrap();
            assert_eq!(s.tree.node(0).len(), 16, "half the root on each rank");
            let root_pages = &s.table[..2];
            let mut own = root_pages.to_vec();
            for &p in t.pages(root).unwrap().iter().filter(|p| p.rank == rank) {
                assert!(own.contains(&p.page));
                own.retain(|&x| x != p.page);
            }
            assert!(own.is_empty(), "rank {rank}'s root pages are its own");
            for q in 0..2 {
                assert_eq!(s.tree.query_context(q)[0], s.tree.node(0).kv);
            }
        }
        assert_eq!(t.snapshot(0).unwrap().tree.node(1).len(), 3);
        assert_eq!(t.snapshot(1).unwrap().tree.node(1).len(), 0);
        assert_eq!(t.prune(root).unwrap(), 7);
        assert_eq!(t.pages_in_use(), 0);
    }

    /// A rank without room is named, with its pool's size, and the call takes nothing.
    #[test]
    fn a_full_rank_is_named_and_nothing_is_taken() {
        let mut t = KvManager::new(2, 4, 2).unwrap();
        let e = t.add_root(20, CONTIGUOUS).unwrap_err(); // 5 pages: 2 on rank 0, 3 on rank 1
        assert_eq!(
            e,
            KvError::PoolFull {
                rank: 1,
                need: 3,
                free: 2,
                pages: 2
            }
        );
        let msg = e.to_string();
        assert!(
            msg.contains("rank 1's KV pool is full") && msg.contains("of its 2"),
            "{msg}"
        );
        assert_eq!(t.pages_in_use(), 0);
        let r = t.add_root(16, CONTIGUOUS).unwrap();
        let e = t.append(r, 1, BALANCED).unwrap_err().to_string();
        assert!(e.contains("rank 0's KV pool is full"), "{e}");
        assert_eq!(t.len(r).unwrap(), 16);
        assert!(matches!(
            t.snapshot(2),
            Err(KvError::NoRank { rank: 2, ranks: 2 })
        ));
        assert!(KvManager::new(0, 16, 1).is_err() && KvManager::new(1, 0, 1).is_err());
    }

    /// A rank that holds nothing of some nodes, or of the whole tree, still gets the whole
    /// topology: empty nodes, an empty page table, and plans of no groups from every planner.
    #[test]
    fn empty_shards_are_trees_every_planner_accepts() {
        let mut t = KvManager::new(3, 16, 8).unwrap();
        let root = t.add_root(20, BALANCED).unwrap(); // ranks 0, 1
        let leaf = t.fork(root, 5, BALANCED).unwrap(); // rank 2
        t.set_live(leaf, true).unwrap();
        t.set_live(root, true).unwrap();
        let shape = AttnShape::new(4, 2, 64).unwrap();
        let cfg = PlannerConfig::default();
        let empty = KvManager::new(2, 16, 8).map(|mut e| {
            let r = e.add_root(3, BALANCED).unwrap();
            e.set_live(r, true).unwrap();
            e.snapshot(1).unwrap()
        });
        let mut snaps = t.snapshots().unwrap();
        snaps.push(empty.unwrap());
        for s in &snaps {
            assert_eq!(s.tree.nodes().len(), s.tree.dfs_order().len());
            let shard = Shard::whole(&s.tree);
            let view = TreeView::new(&s.tree, &shard);
            for m in Method::ALL.into_iter().chain([Method::Auto]) {
                let p = plan(&view, m, &shape, &cfg).unwrap();
                p.check_coverage(|q| view.query_context(q))
                    .unwrap_or_else(|e| panic!("rank {} {m}: {e}", s.rank));
            }
        }
        assert_eq!(snaps[2].tree.node(0).len(), 0);
        assert_eq!(snaps[2].tree.node(1).len(), 5);
        assert_eq!(snaps[2].table.len(), 1);
        let nothing = &snaps[3];
        assert_eq!((nothing.tree.total_tokens(), nothing.table.len()), (0, 0));
        let shard = Shard::whole(&nothing.tree);
        let view = TreeView::new(&nothing.tree, &shard);
        assert!(view.query_context(0).is_empty());
        assert!(plan(&view, Method::FastTree, &shape, &cfg)
            .unwrap()
            .groups()
            .is_empty());
    }

    /// Catch-up is rank by rank: a page taken on one rank replans that rank only; appends
    /// inside a page give tails on the page's rank and none elsewhere.
    #[test]
    fn catch_up_is_per_rank() {
        let mut t = KvManager::new(2, 4, 16).unwrap();
        let root = t.add_root(8, CONTIGUOUS).unwrap();
        let a = t.fork(root, 2, BALANCED).unwrap(); // rank 0 (1 + 1 pages: ranks tie)
        let b = t.fork(root, 2, BALANCED).unwrap(); // rank 1
        t.set_live(a, true).unwrap();
        t.set_live(b, true).unwrap();
        let mut snaps = t.snapshots().unwrap();
        t.append(b, 1, BALANCED).unwrap();
        assert_eq!(t.catch_up(&mut snaps[0]), Some(vec![]));
        let b_end = snaps[1].tree.node(2).kv.end;
        assert_eq!(
            t.catch_up(&mut snaps[1]),
            Some(vec![Tail {
                end: b_end,
                new_end: b_end + 1
            }])
        );
        // a fills its page on rank 0 and takes one on rank 1 (one page over two ranks).
        t.append(a, 3, CONTIGUOUS).unwrap();
        let tails = t.catch_up(&mut snaps[0]).unwrap();
        assert_eq!(tails.len(), 1, "a's page on rank 0 filled in place");
        assert_eq!(t.catch_up(&mut snaps[1]), None, "rank 1 took a page");
        snaps[1] = t.snapshot(1).unwrap();
        for (r, s) in snaps.iter().enumerate() {
            let fresh = t.snapshot(r).unwrap();
            assert_eq!((&s.tree, &s.table), (&fresh.tree, &fresh.table));
        }
        t.set_live(a, false).unwrap();
        assert!(
            snaps.iter_mut().all(|s| t.catch_up(s).is_none()),
            "queries moved"
        );
    }

    proptest! {
        /// A tree grown for many decode steps, forking now and then: plans made once per layout
        /// and extended in place (`catch_up` + `Plan::extend_tails`) cover every query's
        /// context exactly, for every method, and DeFT-Node's extended plan is the plan a fresh
        /// snapshot gives.
        #[test]
        fn plans_extended_in_place_match_the_grown_tree(
            page in 1u32..20,
            leaves in 1usize..6,
            steps in proptest::collection::vec(0u8..12, 1..40),
        ) {
            let shape = AttnShape::new(8, 2, 64).unwrap();
            let cfg = PlannerConfig { node_chunk: 7, flatten_block: 5, ..PlannerConfig::default() };
            let mut t = KvManager::new(1, page, 1 << 14).unwrap();
            let root = t.add_root(9, BALANCED).unwrap();
            for i in 0..leaves {
                let leaf = t.fork(root, 1 + i as u32, BALANCED).unwrap();
                t.set_live(leaf, true).unwrap();
            }
            for method in Method::ALL {
                let mut t = t.clone();
                let mut snap = t.snapshot(0).unwrap();
                let shard = Shard::whole(&snap.tree);
                let mut p = plan(&TreeView::new(&snap.tree, &shard), method, &shape, &cfg).unwrap();
                let mut shared = p.kv_shared_tokens();
                for &step in &steps {
                    if step == 0 {
                        // Fork a new live leaf under the first live one's parent.
                        let first = t.live()[0];
                        let parent = t.parent(first).unwrap().unwrap_or(first);
                        let leaf = t.fork(parent, 2, BALANCED).unwrap();
                        t.set_live(leaf, true).unwrap();
                    }
                    for n in t.live() {
                        t.append(n, 1, BALANCED).unwrap();
                    }
                    match t.catch_up(&mut snap) {
                        Some(tails) => {
                            p.extend_tails(&tails);
                            p.grow_shared_tokens(&mut shared, &tails);
                        }
                        None => {
                            snap = t.snapshot(0).unwrap();
                            let shard = Shard::whole(&snap.tree);
                            p = plan(&TreeView::new(&snap.tree, &shard), method, &shape, &cfg).unwrap();
                            shared = p.kv_shared_tokens();
                        }
                    }
                    prop_assert_eq!(&shared, &p.kv_shared_tokens(), "{}: shared tokens grown in place", method);
                    let shard = Shard::whole(&snap.tree);
                    let view = TreeView::new(&snap.tree, &shard);
                    p.check_coverage(|q| view.query_context(q))
                        .map_err(|e| TestCaseError::fail(format!("{method}: {e}")))?;
                    if method == Method::DeftNode {
                        prop_assert_eq!(&p, &plan(&view, method, &shape, &cfg).unwrap());
                    }
                }
            }
        }

        /// Random forks, appends and prunes over 1 to 3 ranks: no physical page is ever owned
        /// twice, each rank's table covers exactly its pages in use, and every node's logical
        /// range fits its pages.
        #[test]
        fn pages_are_never_shared_between_owners(
            ranks in 1usize..=3,
            ops in proptest::collection::vec((0u8..3, 0u32..50, 1u32..40, any::<bool>()), 1..60),
        ) {
            let mut t = KvManager::new(ranks, 16, 4096).unwrap();
            let mut nodes = vec![t.add_root(33, CONTIGUOUS).unwrap()];
            for (op, pick, n, contiguous) in ops {
                let target = nodes[pick as usize % nodes.len()];
                let placement = if contiguous { CONTIGUOUS } else { BALANCED };
                match op {
                    0 => nodes.push(t.fork(target, n, placement).unwrap()),
                    1 => { let _ = t.append(target, n, placement); }
                    _ if nodes.len() > 1 && target != nodes[0] => {
                        t.prune(target).unwrap();
                        nodes.retain(|&x| t.slot(x).is_ok());
                    }
                    _ => {}
                }
            }
            for &n in &nodes { t.set_live(n, true).unwrap(); }
            for RankSnapshot { rank, tree, table, .. } in t.snapshots().unwrap() {
                let mut used: Vec<u32> = Vec::new();
                for node in tree.nodes() {
                    let first = (node.kv.start / 16) as usize;
                    let pages = node.len().div_ceil(16) as usize;
                    used.extend(&table[first..first + pages]);
                }
                used.sort_unstable();
                let before = used.len();
                used.dedup();
                prop_assert_eq!(before, used.len());
                prop_assert_eq!(used.len(), t.pages_in_use_on(rank).unwrap());
            }
        }
    }
}
