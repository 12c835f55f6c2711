//! Sharding a KV tree over ranks along the sequence (flattened token) axis.
//!
//! Each root's subtree is one contiguous run of the depth-first address space; it is split into
//! `p` even, contiguous windows, window `r` going to rank `r`. For one long sequence this is the
//! Tree Attention paper's contiguous sharding; for a batch each request is split over all ranks
//! (so every rank has equal work); for a prefix tree it is DeFT-Flatten's even split of the
//! flattened tree. A query whose context misses a rank's windows gets no groups there and so
//! contributes the empty partial, which the cross-rank merge ignores.

use crate::error::{CoreError, Result};
use crate::plan::Plan;
use crate::tree::{KvTree, NodeId};
use std::ops::Range;

/// One rank's share: a (possibly empty) window of each root's span, in root order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shard {
    pub rank: usize,
    pub ranks: usize,
    pub windows: Vec<Range<u32>>,
}

impl Shard {
    /// The whole tree on one rank.
    pub fn whole(tree: &KvTree) -> Shard {
        Shard {
            rank: 0,
            ranks: 1,
            windows: tree.root_spans(),
        }
    }

    /// Tokens this rank stores.
    pub fn tokens(&self) -> u32 {
        self.windows.iter().map(|w| w.end - w.start).sum()
    }

    /// Where each window starts in the rank's compact local KV store.
    fn local_starts(&self) -> Vec<u32> {
        let mut acc = 0;
        self.windows
            .iter()
            .map(|w| {
                let s = acc;
                acc += w.end - w.start;
                s
            })
            .collect()
    }

    /// Rewrites a plan made in global addresses to this rank's compact local addresses.
    pub fn localize(&self, plan: &Plan) -> Plan {
        let starts = self.local_starts();
        plan.relocated(|r| {
            let w = self
                .windows
                .iter()
                .position(|w| w.start <= r.start && r.end <= w.end)
                .expect("planned ranges lie inside the rank's windows");
            let off = self.windows[w].start - starts[w];
            r.start - off..r.end - off
        })
    }
}

/// Splits every root's span evenly into `ranks` contiguous windows.
pub fn shard_tree(tree: &KvTree, ranks: usize) -> Result<Vec<Shard>> {
    if ranks == 0 {
        return Err(CoreError::Shard("at least one rank is needed".into()));
    }
    let spans = tree.root_spans();
    Ok((0..ranks)
        .map(|rank| Shard {
            rank,
            ranks,
            windows: spans
                .iter()
                .map(|s| {
                    let len = (s.end - s.start) as u64;
                    let lo = s.start + (len * rank as u64 / ranks as u64) as u32;
                    let hi = s.start + (len * (rank as u64 + 1) / ranks as u64) as u32;
                    lo..hi
                })
                .collect(),
        })
        .collect())
}

/// A tree seen through one rank's windows: what the planners read.
#[derive(Debug, Clone, Copy)]
pub struct TreeView<'a> {
    pub tree: &'a KvTree,
    windows: &'a [Range<u32>],
}

impl<'a> TreeView<'a> {
    pub fn new(tree: &'a KvTree, shard: &'a Shard) -> Self {
        debug_assert_eq!(shard.windows.len(), tree.roots().len());
        TreeView {
            tree,
            windows: &shard.windows,
        }
    }

    /// The node's tokens on this rank (a single range, possibly empty, since a node lies in one
    /// root's span and each root has one window).
    pub fn node_kv(&self, node: NodeId) -> Range<u32> {
        let kv = &self.tree.node(node).kv;
        let w = &self.windows[self.tree.root_index(node)];
        let r = kv.start.max(w.start)..kv.end.min(w.end);
        if r.start < r.end {
            r
        } else {
            kv.start..kv.start
        }
    }

    /// Query `q`'s context on this rank, root first.
    pub fn query_context(&self, q: u32) -> Vec<Range<u32>> {
        self.tree
            .path(self.tree.query_node(q))
            .into_iter()
            .map(|n| self.node_kv(n))
            .filter(|r| !r.is_empty())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::Group;
    use crate::tree::TreeBuilder;

    #[test]
    fn even_contiguous_windows_per_root() {
        let mut b = TreeBuilder::new();
        b.add_root(10);
        b.add_root(7);
        let t = b.build().unwrap();
        let shards = shard_tree(&t, 3).unwrap();
        assert_eq!(shards[0].windows, vec![0..3, 10..12]);
        assert_eq!(shards[1].windows, vec![3..6, 12..14]);
        assert_eq!(shards[2].windows, vec![6..10, 14..17]);
        assert_eq!(shards.iter().map(Shard::tokens).sum::<u32>(), 17);
    }

    #[test]
    fn localize_maps_into_compact_storage() {
        let shard = Shard {
            rank: 1,
            ranks: 2,
            windows: vec![5..10, 20..23],
        };
        let plan = Plan::new(1, vec![Group::unmasked(vec![6..8, 20..23], vec![0])]).unwrap();
        assert_eq!(shard.localize(&plan).groups()[0].kv, vec![1..3, 5..8]);
    }

    #[test]
    fn view_clips_nodes_to_the_window() {
        let mut b = TreeBuilder::new();
        let r = b.add_root(8);
        let c = b.add_child(r, 8).unwrap();
        b.add_query(c).unwrap();
        let t = b.build().unwrap();
        let shards = shard_tree(&t, 4).unwrap();
        let v = TreeView::new(&t, &shards[1]);
        assert_eq!(v.node_kv(0), 4..8);
        assert!(v.node_kv(1).is_empty());
        assert_eq!(v.query_context(0), vec![4..8]);
        assert!(TreeView::new(&t, &shards[3]).node_kv(0).is_empty());
    }
}
