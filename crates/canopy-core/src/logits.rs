//! The order of a row's tokens by likelihood, which every sampler and every backend's
//! narrowing of logits ([`top_tokens`], and the CUDA kernel that mirrors it) keep alike: the
//! larger logit first, as [`f32::total_cmp`] orders them, and among equal logits the lower
//! token. A draw made from a row's `k` most likely tokens in this order is then the same draw
//! as from the whole row, on any backend.
//!
//! A row's softmax total at a temperature ([`softmax_total`]) is summed here for the host.

use std::cmp::Ordering;

/// Whether token `a` (logit `x`) comes before token `b` (logit `y`): the order of
/// [`top_tokens`].
pub fn likelier(a: u32, x: f32, b: u32, y: f32) -> Ordering {
    y.total_cmp(&x).then(a.cmp(&b))
}

/// The `k` at most that [`top_tokens`] keeps in order as it scans a row, where a selection
/// over the whole row would cost more.
const SCAN_MOST: usize = 64;

/// The `k` most likely tokens of `row` (all of them if `k` is larger), most likely first.
/// Linear in the row, not `n log n`: a few are kept in order in one scan, in which most
/// tokens cost one comparison; more are selected, then sorted.
pub fn top_tokens(row: &[f32], k: usize) -> Vec<u32> {
    let by = |&a: &u32, &b: &u32| likelier(a, row[a as usize], b, row[b as usize]);
    if k <= SCAN_MOST && k < row.len() {
        let mut best: Vec<u32> = Vec::with_capacity(k + 1);
        for t in 0..row.len() as u32 {
            if best.len() == k && best.last().is_none_or(|last| by(&t, last).is_ge()) {
                continue;
            }
            let at = best.partition_point(|b| by(b, &t).is_lt());
            best.insert(at, t);
            best.truncate(k);
        }
        return best;
    }
    let mut order: Vec<u32> = (0..row.len() as u32).collect();
    let k = k.min(order.len());
    if k == 0 {
        return Vec::new();
    }
    if k < order.len() {
        order.select_nth_unstable_by(k - 1, by);
        order.truncate(k);
    }
    order.sort_unstable_by(by);
    order
}

/// The most likely token of `row` (`None` for an empty row).
pub fn most_likely(row: &[f32]) -> Option<u32> {
    (0..row.len() as u32).min_by(|&a, &b| likelier(a, row[a as usize], b, row[b as usize]))
}

/// The sum of `exp((x - max) / temperature)` over `row`, `max` its largest logit: each term to
/// f32's quotient, the sum in f64 in the row's order.
pub fn softmax_total(row: &[f32], temperature: f32) -> f32 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = row
        .iter()
        .map(|&x| f64::from((x - max) / temperature).exp())
        .sum();
    sum as f32
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn equal_logits_put_the_lower_token_first() {
        assert_eq!(top_tokens(&[1.0, 3.0, 2.0, 3.0, 3.0], 3), vec![1, 3, 4]);
        assert_eq!(most_likely(&[0.5, 2.0, 2.0]), Some(1));
        assert_eq!(most_likely(&[]), None);
        // total_cmp: 0.0 above -0.0, infinities at their ends.
        assert_eq!(
            top_tokens(&[-0.0, 0.0, f32::NEG_INFINITY, f32::INFINITY], 4),
            vec![3, 1, 0, 2]
        );
        assert_eq!(top_tokens(&[1.0, 2.0], 5), vec![1, 0]);
        assert!(top_tokens(&[1.0], 0).is_empty());
    }

    proptest! {
        /// The selection equals the head of a full sort, for rows with many ties.
        #[test]
        fn top_tokens_is_the_head_of_the_whole_order(
            row in proptest::collection::vec(-4i8..4, 1..300),
            k in 1usize..100,
        ) {
            let row: Vec<f32> = row.iter().map(|&x| x as f32 * 0.5).collect();
            let mut all: Vec<u32> = (0..row.len() as u32).collect();
            all.sort_by(|&a, &b| likelier(a, row[a as usize], b, row[b as usize]));
            all.truncate(k);
            prop_assert_eq!(top_tokens(&row, k), all.clone());
            prop_assert_eq!(most_likely(&row), all.first().copied());
        }
    }
}
