//! Which rank a node's new pages go to.

/// Where the pages one call takes are placed.
///
/// A rank's attention work is the KV it holds, so placement is load balance: decode growth
/// goes where the least is; a prefill split along the sequence keeps each chunk where it was
/// computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Placement {
    /// Each new page on the rank with the fewest pages in use, ties to the lowest rank.
    #[default]
    Balanced,
    /// The call's `n` new pages in equal contiguous blocks over the `p` ranks: rank `r` takes
    /// pages `n·r/p .. n·(r+1)/p` (rounded down), the split [`canopy_core::shard_tree`] makes
    /// of tokens, in whole pages. A sequence-parallel prefill that gives rank `r` the `r`-th
    /// chunk of the prompt ([`crate::KvManager::runs`]) writes its KV into pages rank `r`
    /// owns.
    Contiguous,
    /// The call's `n` new pages in `2p` equal contiguous blocks: rank `r` takes blocks `r`
    /// and `2p - 1 - r` (block `b` is pages `n·b/2p .. n·(b+1)/2p`, rounded down). Under a
    /// causal mask a query sees the keys before it, so a rank with an early block also has a
    /// late one, and the ranks' queries over the call's tokens see as many keys on every rank
    /// (a contiguous split gives the last rank `2 - 1/p` times the mean). A sequence-parallel
    /// prefill that gives each rank the tokens of its pages balances its attention so.
    Zigzag,
}

impl Placement {
    /// The rank of each of `pages` new pages, in token order, given each rank's pages in use.
    pub fn ranks(self, pages: usize, in_use: &[usize]) -> Vec<usize> {
        let p = in_use.len();
        match self {
            Placement::Balanced => {
                let mut in_use = in_use.to_vec();
                (0..pages)
                    .map(|_| {
                        let (rank, _) = in_use
                            .iter()
                            .enumerate()
                            .min_by_key(|&(r, &n)| (n, r))
                            .expect("a cache has at least one rank");
                        in_use[rank] += 1;
                        rank
                    })
                    .collect()
            }
            Placement::Contiguous => (0..p)
                .flat_map(|r| {
                    let block = pages * r / p..pages * (r + 1) / p;
                    block.map(move |_| r)
                })
                .collect(),
            Placement::Zigzag => {
                let blocks = 2 * p;
                (0..blocks)
                    .flat_map(|b| {
                        let rank = if b < p { b } else { blocks - 1 - b };
                        (pages * b / blocks..pages * (b + 1) / blocks).map(move |_| rank)
                    })
                    .collect()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn balanced_fills_the_emptiest_rank_first_and_breaks_ties_low() {
        assert_eq!(Placement::Balanced.ranks(4, &[2, 0, 1]), [1, 1, 2, 0]);
        assert_eq!(Placement::Balanced.ranks(3, &[0, 0]), [0, 1, 0]);
        assert!(Placement::Balanced.ranks(0, &[0]).is_empty());
    }

    #[test]
    fn contiguous_gives_rank_r_the_r_th_block() {
        assert_eq!(
            Placement::Contiguous.ranks(8, &[5, 0, 0, 0]),
            [0, 0, 1, 1, 2, 2, 3, 3]
        );
        assert_eq!(Placement::Contiguous.ranks(5, &[0, 0]), [0, 0, 1, 1, 1]);
        // Fewer pages than ranks: the low ranks get none, as shard_tree's low windows would.
        assert_eq!(Placement::Contiguous.ranks(2, &[0, 0, 0, 0]), [1, 3]);
    }

    #[test]
    fn zigzag_gives_rank_r_the_r_th_block_and_its_mirror() {
        assert_eq!(
            Placement::Zigzag.ranks(8, &[3, 0]),
            [0, 0, 1, 1, 1, 1, 0, 0]
        );
        assert_eq!(Placement::Zigzag.ranks(6, &[0, 0, 0]), [0, 1, 2, 2, 1, 0]);
        assert_eq!(Placement::Zigzag.ranks(5, &[0, 0]), [0, 1, 1, 0, 0]);
        assert_eq!(Placement::Zigzag.ranks(3, &[0]), [0, 0, 0]);
    }
}
