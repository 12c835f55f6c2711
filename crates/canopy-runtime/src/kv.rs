//! A generation's KV bookkeeping on the KV-cache manager: the prompt as one root, placed piece
//! by piece (a prefill pass each), every piece over the ranks in [`Placement::Zigzag`]'s
//! blocks (a rank's chunk of a piece, the tokens it prefills, is an early block and its
//! mirror, so that every rank's queries see as many keys), and each sample as a branch of it
//! whose tokens go, page by page, to the rank with the fewest pages (so decode's attention
//! work stays balanced). Every rank keeps the same bookkeeping, so all agree where each token
//! lives without talking.

use crate::{Result, RuntimeError};
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
    /// Only appends inside the addresses its nodes had: extend the plan by these tails, and
    /// install `table` (the same size, pages new in reserved room) where there is one.
    Grown {
        tails: Vec<Tail>,
        table: Option<Vec<u32>>,
    },
}

/// Addresses a tree-decoded leaf keeps free past its tokens on each rank
/// ([`KvManager::with_growth_room`]): a rank's plan, page table and recorded decode graph then
/// carry over the pages its leaves take, and a leaf's own growth replans its rank at most
/// once in this many steps. The room costs page-table entries, not pages. The ring sends
/// every logical address of a shard around, so it keeps none. A server's leaves keep this
/// room; `generate`'s keep [`SEQUENCE_GROWTH_ROOM`].
pub const GROWTH_ROOM: u32 = 128;

/// [`GROWTH_ROOM`] for `generate`'s requests, whose plans change only when a leaf outgrows
/// its room (a server's also change with its batch). Between those replans the plan is
/// extended in place, and a leaf's new tokens all land in the last piece of its group's cut,
/// which the cut leaves this much short
/// ([`CUT_TAIL_ROOM`](canopy_core::geometry::CUT_TAIL_ROOM)). With 128 tokens of room and an
/// even cut, that piece's CTAs ran longest: over 150 tokens of the Llama-3.1-8B shape on an
/// H100, 6.444 ms/token at 8K and 7.590 at 32K (median), against 6.291 and 7.357 with 32
/// (docs/BENCHMARKS.md, session 37). A replan whose plan lays out as the uploaded one is
/// written over it and the step's graph still replays; any other re-records the graph, about
/// 2.5 ms once.
pub const SEQUENCE_GROWTH_ROOM: u32 = canopy_core::geometry::CUT_TAIL_ROOM;

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
    /// The prompt's pieces, in order: one prefill pass each.
    pieces: Vec<Range<usize>>,
    /// The prompt's maximal runs of tokens held by one rank: `(rank, positions)`, in order.
    runs: Vec<(usize, Range<usize>)>,
    samples: Vec<Option<KvNode>>,
    pages_per_rank: u32,
}

impl KvLayout {
    /// Room for a prompt of `prompt` tokens and `samples` samples of up to `max_tokens`
    /// tokens each, over `ranks` ranks; the prompt is prefilled in pieces of `chunk` tokens a
    /// rank (rounded up to whole pages), so `ranks · chunk` tokens a piece.
    pub fn new(
        ranks: usize,
        page_size: u32,
        prompt: usize,
        samples: usize,
        max_tokens: usize,
        chunk: usize,
    ) -> Result<KvLayout> {
        let ps = page_size as usize;
        let pages = |tokens: usize| tokens.div_ceil(ps);
        // The prompt's share (every full piece splits evenly, the last as evenly as pages
        // allow), every sample's growth if one rank took it all, and a partial page per sample.
        // Positions, and a rank's pages and tokens, are 32-bit.
        let pages_per_rank = (pages(max_tokens) + 1)
            .checked_mul(samples)
            .and_then(|growth| growth.checked_add(pages(prompt).div_ceil(ranks)))
            .and_then(|pages| u32::try_from(pages).ok())
            .filter(|&pages| pages.checked_mul(page_size).is_some())
            .filter(|_| u32::try_from(prompt.saturating_add(max_tokens)).is_ok())
            .ok_or(RuntimeError::TooManyTokens {
                prompt,
                samples,
                max_tokens,
            })?;
        let mut manager = KvManager::new(ranks, page_size, pages_per_rank)?;
        let piece = chunk.max(1).div_ceil(ps) * ps * ranks;
        let pieces: Vec<Range<usize>> = (0..prompt)
            .step_by(piece)
            .map(|start| start..(start + piece).min(prompt))
            .collect();
        let first = pieces.first().map_or(0, |p| p.len());
        let root = manager.add_root(first as u32, Placement::Zigzag)?;
        for p in pieces.iter().skip(1) {
            manager.append(root, p.len() as u32, Placement::Zigzag)?;
        }
        let runs = manager
            .runs(root)?
            .into_iter()
            .map(|(rank, t)| (rank, t.start as usize..t.end as usize))
            .collect();
        Ok(KvLayout {
            manager,
            steps: StepLayout::new(),
            root,
            pieces,
            runs,
            samples: vec![None; samples],
            pages_per_rank,
        })
    }

    /// Snapshots keep `tokens` addresses of room past each live sample's tokens
    /// ([`GROWTH_ROOM`]).
    pub fn with_growth_room(mut self, tokens: u32) -> KvLayout {
        self.manager = self.manager.with_growth_room(tokens);
        self
    }

    /// Tokens each rank's storage holds (its whole pool).
    pub fn pool_tokens(&self) -> usize {
        (self.pages_per_rank * self.manager.page_size()) as usize
    }

    /// The prompt's pieces, in order: one prefill pass each.
    pub fn pieces(&self) -> &[Range<usize>] {
        &self.pieces
    }

    /// The prompt positions rank `rank` holds, as runs in order: its chunk of each piece.
    pub fn prompt_runs(&self, rank: usize) -> impl Iterator<Item = Range<usize>> + '_ {
        self.runs
            .iter()
            .filter(move |(r, _)| *r == rank)
            .map(|(_, t)| t.clone())
    }

    /// Each rank's chunk of `piece`, in rank order: the positions of the piece it holds, in
    /// order (two runs, [`Placement::Zigzag`]'s blocks; none for a rank when the piece has
    /// fewer pages than blocks).
    pub fn chunks(&self, piece: &Range<usize>) -> Vec<Vec<usize>> {
        let mut chunks = vec![Vec::new(); self.manager.ranks()];
        for (rank, run) in &self.runs {
            chunks[*rank].extend(run.start.max(piece.start)..run.end.min(piece.end));
        }
        chunks
    }

    /// The most tokens one rank prefills in one pass (its widest chunk of any piece).
    pub fn widest_chunk(&self) -> usize {
        (self.pieces.iter())
            .flat_map(|piece| self.chunks(piece))
            .map(|chunk| chunk.len())
            .max()
            .unwrap_or(0)
    }

    /// The physical slot of each of the prompt positions `tokens` (all held by one rank).
    pub fn prompt_slots(&self, tokens: impl IntoIterator<Item = usize>) -> Vec<u32> {
        (tokens.into_iter())
            .map(|i| self.slot(self.root, i as u32).1)
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
                RankUpdate::Grown { tails, table } => RankChange::Grown {
                    tails,
                    table: table.map(<[u32]>::to_vec),
                },
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The query-key pairs each rank's prefill attends in each piece, as `prefill` splits the
    /// work: in the first piece a rank's own rows over the piece's keys before them; in a
    /// later one every row of the piece over the keys the rank holds before it.
    fn pairs_by_rank(kv: &KvLayout, ranks: usize) -> Vec<Vec<u64>> {
        (kv.pieces().iter().enumerate())
            .map(|(j, piece)| {
                let chunks = kv.chunks(piece);
                (0..ranks)
                    .map(|r| match j {
                        0 => chunks[r]
                            .iter()
                            .map(|&p| (p - piece.start + 1) as u64)
                            .sum(),
                        _ => (kv.prompt_runs(r).flatten())
                            .filter(|&k| k < piece.end)
                            .map(|k| (piece.end - k.max(piece.start)) as u64)
                            .sum(),
                    })
                    .collect()
            })
            .collect()
    }

    #[test]
    fn every_piece_is_cut_once_over_the_ranks_in_order() {
        for ranks in 1..=5 {
            for prompt in [1, 15, 16, 100, 1000, 3001] {
                let kv = KvLayout::new(ranks, 16, prompt, 1, 4, 64).unwrap();
                let mut seen = Vec::new();
                for piece in kv.pieces() {
                    let chunks = kv.chunks(piece);
                    for (rank, chunk) in chunks.iter().enumerate() {
                        assert!(chunk.windows(2).all(|w| w[0] < w[1]), "rank {rank}");
                        let runs: Vec<_> = kv.prompt_runs(rank).flatten().collect();
                        assert!(chunk.iter().all(|p| runs.contains(p)), "rank {rank}");
                    }
                    let mut all: Vec<usize> = chunks.concat();
                    all.sort_unstable();
                    assert_eq!(all, piece.clone().collect::<Vec<_>>());
                    seen.extend(all);
                }
                assert_eq!(seen, (0..prompt).collect::<Vec<_>>());
            }
        }
    }

    /// The ranks' exchange meets once a layer, so the slowest rank sets a piece's pace: every
    /// rank attends about the mean number of pairs in every piece of at least a few pages a
    /// block (a contiguous cut gives the last rank `2 - 1/p` times the mean in the first).
    #[test]
    fn every_rank_attends_about_the_mean_in_every_piece() {
        for ranks in 2..=8 {
            for prompt in [4096, 10_000, 40_000] {
                let kv = KvLayout::new(ranks, 16, prompt, 1, 4, 512).unwrap();
                for (piece, pairs) in kv.pieces().iter().zip(pairs_by_rank(&kv, ranks)) {
                    if piece.len() < 2 * ranks * 8 * 16 {
                        continue;
                    }
                    let mean = pairs.iter().sum::<u64>() as f64 / ranks as f64;
                    let most = *pairs.iter().max().unwrap() as f64;
                    assert!(
                        most <= 1.05 * mean,
                        "{ranks} ranks, {prompt} tokens, piece {piece:?}: {pairs:?}"
                    );
                }
            }
        }
    }
}
