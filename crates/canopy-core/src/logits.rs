//! The order of a row's tokens by likelihood, which every sampler and every backend's
//! narrowing of logits ([`top_tokens`], and the CUDA kernel that mirrors it) keep alike: the
//! larger logit first, as [`f32::total_cmp`] orders them, and among equal logits the lower
//! token. A draw made from a row's `k` most likely tokens in this order is then the same draw
//! as from the whole row, on any backend.
//!
//! A row's softmax total at a temperature ([`softmax_total`]) is summed here for the host, and
//! the rest of a draw by that total walked past a row's likeliest tokens ([`TailWalk`]).

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

/// The rest of a draw by a row's softmax total that walked the row's likeliest tokens (its
/// `head`) without landing: the walk over the other tokens by token id, each's probability
/// `exp((x - max) / temperature) / total` (the quotient in f32, the rest in f64), `target`
/// lessened by each token it passes, landing on the first whose probability is above what is
/// left. A backend walks it where the row lies ([`TailWalk::land`] is the host's walk).
#[derive(Debug, Clone, PartialEq)]
pub struct TailWalk {
    /// The tokens walked already, in any order; with a `cut`, the head in its walk's order.
    pub head: Vec<u32>,
    /// The row's largest logit.
    pub max: f32,
    pub temperature: f32,
    pub total: f64,
    /// What is left of the draw's uniform number, in probability, after the head (none with a
    /// `cut`, whose target follows from the tokens it keeps).
    pub target: f64,
    /// A `top_p` cut past the head ([`TailCut`]).
    pub cut: Option<TailCut>,
    /// Logits the walk reads in place of the row's, by token id: a draw's that changes logits
    /// (penalties, biases), its head's (which a cut walks in order) and its changed tokens'
    /// past the head.
    pub changed: Vec<(u32, f32)>,
}

/// A `top_p` cut that the head of a draw by total does not reach: the draw keeps the head and
/// the fewest likeliest tokens past it whose probability brings the head's to `top_p` (the
/// kept mass `M`), and walks the head in order, then the kept tokens by token id, from a
/// target of `u · (head_mass + M)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TailCut {
    /// The draw's uniform number.
    pub u: f64,
    pub top_p: f64,
    /// The head's probability, summed in its order.
    pub head_mass: f64,
}

impl TailWalk {
    /// The probability of a token whose logit is `x`.
    pub fn prob(&self, x: f32) -> f64 {
        f64::from((x - self.max) / self.temperature).exp() / self.total
    }

    /// Where the walk lands in `row` (with the walk's `changed` logits in place): the first
    /// token past the head by token id (with a cut, the head's in order, then the kept ones by
    /// token id) at which the target falls below its probability; where the walk passes them
    /// all (the total's rounding), the last of them with a probability above 0; `None` where
    /// none has one.
    pub fn land(&self, row: &[f32]) -> Option<u32> {
        let mut changed_row: Vec<f32> = Vec::new();
        let row = match self.changed.is_empty() {
            true => row,
            false => {
                changed_row.extend_from_slice(row);
                for &(t, x) in &self.changed {
                    if let Some(at) = changed_row.get_mut(t as usize) {
                        *at = x;
                    }
                }
                &changed_row
            }
        };
        let mut past: Vec<bool> = vec![true; row.len()];
        self.head.iter().for_each(|&t| past[t as usize] = false);
        let (mut target, mut last) = (self.target, None);
        if let Some(cut) = self.cut {
            // The kept tokens past the head, found by selection, set the draw's scale.
            let mut rest: Vec<(u32, f32, f64)> = (0..row.len() as u32)
                .filter(|&t| past[t as usize])
                .map(|t| (t, row[t as usize], self.prob(row[t as usize])))
                .collect();
            let m = likeliest_reaching(&mut rest, cut.top_p - cut.head_mass);
            let kept: f64 = rest[..m].iter().map(|&(_, _, q)| q).sum();
            past.iter_mut().for_each(|p| *p = false);
            rest[..m]
                .iter()
                .for_each(|&(t, _, _)| past[t as usize] = true);
            target = cut.u * (cut.head_mass + kept);
        }
        let mut take = |t: u32| {
            let q = self.prob(row[t as usize]);
            if target < q {
                return true;
            }
            target -= q;
            if q > 0.0 {
                last = Some(t);
            }
            false
        };
        // A cut walks its head first; a walk without one starts past it.
        let walked: &[u32] = if self.cut.is_some() { &self.head } else { &[] };
        if let Some(&t) = walked.iter().find(|&&t| take(t)) {
            return Some(t);
        }
        match (0..row.len() as u32).find(|&t| past[t as usize] && take(t)) {
            Some(t) => Some(t),
            None => last,
        }
    }
}

/// Puts first, in no order, the fewest of the most likely `items` (token, logit,
/// probability) whose probabilities reach `need`, and returns how many (all, where they do not
/// reach it): a selection that halves the range each round, linear in the items on average.
pub fn likeliest_reaching(items: &mut [(u32, f32, f64)], mut need: f64) -> usize {
    let (mut lo, mut hi) = (0, items.len());
    while lo < hi {
        // The range's likelier half before its middle item.
        let mid = (hi - lo) / 2;
        items[lo..hi].select_nth_unstable_by(mid, |a, b| likelier(a.0, a.1, b.0, b.1));
        let upper: f64 = items[lo..lo + mid].iter().map(|&(_, _, q)| q).sum();
        if mid > 0 && upper >= need {
            hi = lo + mid;
            continue;
        }
        need -= upper;
        let q = items[lo + mid].2;
        if q >= need {
            return lo + mid + 1;
        }
        need -= q;
        lo += mid + 1;
    }
    lo
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

    #[test]
    fn a_tail_walk_skips_the_head_and_lands_where_its_target_falls() {
        let row = [0.0f32, 0.0, 0.0, 0.0];
        let walk = |head: Vec<u32>, target| TailWalk {
            head,
            max: 0.0,
            temperature: 1.0,
            total: 4.0,
            target,
            cut: None,
            changed: vec![],
        };
        // Each token weighs 1/4; the head's are passed by.
        assert_eq!(walk(vec![], 0.3).land(&row), Some(1));
        assert_eq!(walk(vec![1], 0.3).land(&row), Some(2));
        assert_eq!(walk(vec![3, 0], 0.1).land(&row), Some(1));
        // Past every token: the last one passed; none past the head: none.
        assert_eq!(walk(vec![3], 0.9).land(&row), Some(2));
        assert_eq!(walk(vec![0, 1, 2, 3], 0.1).land(&row), None);
    }

    proptest! {
        /// The selection keeps what a sort would: the fewest likeliest items whose
        /// probabilities reach the need (sums exact in f64: multiples of 1/1024).
        #[test]
        fn the_selection_keeps_the_likeliest_that_reach_the_need(
            items in proptest::collection::vec((0i32..6, 1u32..64), 0..300),
            need in 0u32..20_000,
        ) {
            let mut items: Vec<(u32, f32, f64)> = (items.iter().enumerate())
                .map(|(t, &(logit, weight))| (t as u32, logit as f32, weight as f64 / 1024.0))
                .collect();
            let need = need as f64 / 1024.0;
            let mut sorted = items.clone();
            sorted.sort_by(|a, b| likelier(a.0, a.1, b.0, b.1));
            let mut acc = 0.0;
            let want = sorted
                .iter()
                .position(|&(_, _, q)| {
                    acc += q;
                    acc >= need
                })
                .map_or(sorted.len(), |i| i + 1);
            let m = likeliest_reaching(&mut items, need);
            prop_assert_eq!(m, want);
            let mut kept: Vec<u32> = items[..m].iter().map(|i| i.0).collect();
            let mut wanted: Vec<u32> = sorted[..m].iter().map(|i| i.0).collect();
            kept.sort_unstable();
            wanted.sort_unstable();
            prop_assert_eq!(kept, wanted);
        }
    }
}
