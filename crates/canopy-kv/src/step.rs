//! What each rank does before a decode step, whatever backend runs it.
//!
//! A decode loop appends the step's tokens to the cache, then asks [`StepLayout::update`]
//! what changed for each rank: a fresh layout (plan the rank's new snapshot, install its page
//! table, size the buffers) or growth in place (extend the plan already on the device by the
//! tails, and install the table again where pages came into reserved room). The first update
//! is fresh on every rank.

use crate::error::Result;
use crate::paged::{KvManager, RankSnapshot};
use canopy_core::Tail;

/// Every rank's current snapshot of one [`KvManager`], kept up to date step by step.
#[derive(Debug, Clone, Default)]
pub struct StepLayout {
    snaps: Vec<RankSnapshot>,
}

/// What one rank's executor does before a step.
#[derive(Debug, Clone, PartialEq)]
pub enum RankUpdate<'a> {
    /// The rank's layout moved: plan this snapshot afresh and install its page table.
    Fresh(&'a RankSnapshot),
    /// Only appends inside the addresses the rank's nodes had: extend its plan by these tails
    /// (none when nothing grew there). `table`: the rank's page table, when pages came into
    /// reserved room ([`KvManager::with_growth_room`]): install it again, at the same size.
    Grown {
        tails: Vec<Tail>,
        table: Option<&'a [u32]>,
    },
}

impl StepLayout {
    /// No snapshot yet: the first [`update`](Self::update) is fresh on every rank.
    pub fn new() -> StepLayout {
        StepLayout::default()
    }

    /// Brings every rank's snapshot up to date with `kv` (the manager all earlier updates
    /// read), after this step's appends, and says per rank, in rank order, what changed.
    pub fn update(&mut self, kv: &KvManager) -> Result<Vec<RankUpdate<'_>>> {
        if self.snaps.len() != kv.ranks() {
            self.snaps = kv.snapshots()?;
            return Ok(self.snaps.iter().map(RankUpdate::Fresh).collect());
        }
        let mut grown = Vec::with_capacity(self.snaps.len());
        for (rank, snap) in self.snaps.iter_mut().enumerate() {
            let tails = kv.catch_up(snap);
            if tails.is_none() {
                *snap = kv.snapshot(rank)?;
            }
            grown.push(tails);
        }
        Ok(self
            .snaps
            .iter()
            .zip(grown)
            .map(|(snap, caught)| match caught {
                None => RankUpdate::Fresh(snap),
                Some(c) => RankUpdate::Grown {
                    tails: c.tails,
                    table: c.new_pages.then_some(&snap.table[..]),
                },
            })
            .collect())
    }

    /// Rank `rank`'s snapshot as of the last update (`None` before the first).
    pub fn rank(&self, rank: usize) -> Option<&RankSnapshot> {
        self.snaps.get(rank)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Placement::{Balanced, Contiguous};

    #[test]
    fn fresh_first_then_grown_or_fresh_rank_by_rank() {
        let mut kv = KvManager::new(2, 4, 8).unwrap();
        let root = kv.add_root(8, Contiguous).unwrap();
        let leaf = kv.fork(root, 1, Balanced).unwrap(); // rank 0
        kv.set_live(leaf, true).unwrap();
        let mut layout = StepLayout::new();
        assert!(layout.rank(0).is_none());
        let ranks: Vec<usize> = layout
            .update(&kv)
            .unwrap()
            .into_iter()
            .map(|u| match u {
                RankUpdate::Fresh(snap) => snap.rank,
                RankUpdate::Grown { .. } => panic!("the first update is fresh"),
            })
            .collect();
        assert_eq!(ranks, [0, 1]);
        kv.append(leaf, 1, Balanced).unwrap();
        let end = layout.rank(0).unwrap().tree.node(1).kv.end;
        assert_eq!(
            layout.update(&kv).unwrap(),
            [
                RankUpdate::Grown {
                    tails: vec![Tail {
                        end,
                        new_end: end + 1
                    }],
                    table: None
                },
                RankUpdate::Grown {
                    tails: vec![],
                    table: None
                }
            ]
        );
        kv.append(leaf, 3, Balanced).unwrap(); // fills rank 0's page, takes one on rank 1
        let fresh = kv.snapshot(1).unwrap();
        match &layout.update(&kv).unwrap()[..] {
            [RankUpdate::Grown { tails, table: None }, RankUpdate::Fresh(snap)] => {
                assert_eq!(tails.len(), 1);
                assert_eq!((&snap.tree, &snap.table), (&fresh.tree, &fresh.table));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(layout.rank(1).unwrap().tree.node(1).len(), 1);
    }
}
