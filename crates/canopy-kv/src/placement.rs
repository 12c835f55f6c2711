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
}
