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
//! Most decode steps change no layout: every live leaf appends a token inside the addresses
//! its rank's snapshot gave it (its last page, or the growth room reserved past it), so no
//! node moves. [`KvManager::catch_up`] recognises such steps rank by rank and brings that
//! rank's snapshot up to date in place, returning each node that grew there as a [`Tail`]
//! (old end, new end) and writing pages taken into room into the table; a plan follows with
//! [`canopy_core::Plan::extend_tails`] instead of being rebuilt. A node past its addresses
//! on the rank, or any change of topology (a fork, a prune, a query set), means a new
//! snapshot is due; growth on another rank changes nothing here.

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
    /// Appends do not move it.
    topology: u64,
    /// Addresses a snapshot keeps free past each live leaf's tokens (see
    /// [`with_growth_room`](Self::with_growth_room)).
    growth_room: u32,
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
    /// The cache's topology when taken.
    topology: u64,
    /// For each cache node: where `tree` laid it out.
    nodes: Vec<Option<Laid>>,
}

/// One cache node in a snapshot's tree.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Laid {
    id: NodeId,
    /// The tokens `tree` has for it.
    len: u32,
    /// The tokens it may grow to in place: the end of its last page, or of its reserved room.
    capacity: u32,
}

/// What [`KvManager::catch_up`] did to a snapshot.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct CaughtUp {
    /// The nodes that grew on the snapshot's rank, in its logical addresses.
    pub tails: Vec<Tail>,
    /// Whether the page table gained pages (in reserved room): a reader installs it again.
    pub new_pages: bool,
}

impl RankSnapshot {
    /// The node of [`tree`](Self::tree) that holds cache node `node`'s tokens on this rank
    /// (`None`: `node` did not exist when the snapshot was taken).
    pub fn node(&self, node: KvNode) -> Option<NodeId> {
        self.nodes.get(node as usize)?.map(|laid| laid.id)
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
        };
        Ok(KvManager {
            page_size,
            pools: vec![pool; ranks],
            slots: Vec::new(),
            roots: Vec::new(),
            topology: 0,
            growth_room: 0,
        })
    }

    /// Snapshots keep at least `tokens` addresses (whole pages) free past each live leaf's
    /// tokens on every rank, so a decoding leaf that takes new pages still grows in place:
    /// [`catch_up`](Self::catch_up) writes the pages into the table's reserved entries and the
    /// plans follow by tails, where without room every page taken means a new snapshot and a
    /// new plan. The room costs page-table entries only, no pages.
    pub fn with_growth_room(mut self, tokens: u32) -> KvManager {
        self.growth_room = tokens;
        self
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
    /// For a prompt placed [`Placement::Contiguous`], run `r` is the chunk rank `r` prefills;
    /// placed [`Placement::Zigzag`], runs `r` and `2p - 1 - r` are.
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
        self.pool(rank)?;
        for &n in queries {
            self.slot(n)?;
        }
        let mut b = TreeBuilder::new()
            .with_alignment(self.page_size)
            .with_empty_nodes();
        let mut ids = vec![None; self.slots.len()];
        let mut capacity = vec![0; self.slots.len()];
        // Parents before children: walk from the roots.
        let mut stack: Vec<KvNode> = self.roots.iter().rev().copied().collect();
        let mut order = Vec::new();
        while let Some(n) = stack.pop() {
            let s = self.slot(n)?;
            let held = s.held[rank];
            let id = match s.parent {
                None => b.add_root(held),
                Some(p) => b.add_child(ids[p as usize].expect("parent first"), held)?,
            };
            // A leaf's first token on a rank moves the snapshot anyway (an empty node's
            // address may be where another node ends), so only held leaves get room.
            let room = if s.live && s.children.is_empty() && held > 0 {
                self.growth_room
            } else {
                0
            };
            capacity[n as usize] = (held + room).next_multiple_of(self.page_size);
            b.reserve(id, capacity[n as usize] - held)?;
            ids[n as usize] = Some(id);
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
            nodes[n as usize] = Some(Laid {
                id,
                len: node.len(),
                capacity: capacity[n as usize],
            });
        }
        Ok(RankSnapshot {
            rank,
            tree,
            table,
            topology: self.topology,
            nodes,
        })
    }

    /// Brings `snap` up to date when nothing but appends happened since it was taken (or last
    /// caught up), each inside the addresses its node had there: its last page, or the room
    /// [`with_growth_room`](Self::with_growth_room) reserved, whose new pages go into the
    /// table. `None`: the layout moved (a fork, a prune, a query set, a node past its room);
    /// take a new [`snapshot`](Self::snapshot) of the rank.
    pub fn catch_up(&self, snap: &mut RankSnapshot) -> Option<CaughtUp> {
        if snap.rank >= self.pools.len() || snap.topology != self.topology {
            return None;
        }
        let grown: Vec<(&Slot, &mut Laid, u32)> = self
            .slots
            .iter()
            .zip(&mut snap.nodes)
            .filter_map(|(slot, laid)| {
                let (slot, laid) = (slot.as_ref()?, laid.as_mut()?);
                let held = slot.held[snap.rank];
                (held != laid.len).then_some((slot, laid, held))
            })
            .collect();
        if grown.iter().any(|(_, laid, held)| *held > laid.capacity) {
            return None;
        }
        let page = self.page_size;
        let mut caught = CaughtUp::default();
        for (slot, laid, held) in grown {
            let start = snap.tree.node(laid.id).kv.start;
            let (had, has) = (laid.len.div_ceil(page), held.div_ceil(page));
            if has > had {
                let here = slot.pages.iter().filter(|p| p.rank == snap.rank);
                let first = (start / page + had) as usize;
                for (entry, p) in snap.table[first..].iter_mut().zip(here.skip(had as usize)) {
                    *entry = p.page;
                }
                caught.new_pages = true;
            }
            let tail = Tail {
                end: start + laid.len,
                new_end: start + held,
            };
            snap.tree.extend_node(laid.id, tail.new_end);
            laid.len = held;
            caught.tails.push(tail);
        }
        Some(caught)
    }
}

#[cfg(test)]
#[path = "paged_tests.rs"]
mod tests;
