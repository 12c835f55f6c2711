//! Draws that change logits: penalties over the tokens a sample repeats, and fixed biases
//! ([`Sampler::adjust`]). Such a draw reads its row narrowed to its likeliest tokens, with the
//! logits of the tokens it changes picked beside them on the backend
//! ([`canopy_engine::LayerOps::pick_logits`]), not its whole row.
//!
//! **The changed row's likeliest.** Of a row narrowed to its `n` likeliest tokens, `c` of
//! which the draw changes, the `want` likeliest after the change are among the narrowed and
//! the changed tokens when `want + c ≤ n`. A token the change leaves as it is keeps the
//! unchanged tokens above it; among the `want` likeliest after the change it has fewer than
//! `want` of them above it, so fewer than `want + c` tokens of any kind before the change,
//! and it is one of the narrowed. A changed token past the narrowed that the change lowers
//! stays below their `n - c ≥ want` unchanged ones. So a draw picks the tokens the change may
//! lift, and reads its row whole where `want + c > n`.
//!
//! **The changed row's total.** A draw over the whole vocabulary walks the changed row's
//! `max(1, n - c)` likeliest in order, then the changed tokens past them by token id, then the
//! rest of the row by token id, which a backend may walk ([`Sampler::tail_walk`]). Each
//! token's probability is its term over the changed row's softmax total: the backend's total
//! of the tokens the draw leaves as they are (the picked ones left out of its sum), and the
//! changed tokens' terms, which the host adds. Nothing is taken away, so a change that takes
//! most of a row's mass (a penalised token that held it) leaves the total as exact as the
//! backend's sum. Such a draw picks every token it changes.

use super::by_total::{ByTotal, BY_TOTAL_HEAD};
use super::{RowLogits, Sampler};
use canopy_core::logits::{likelier, softmax_total, top_tokens};
use canopy_engine::TOP_LOGITS_MAX;

/// The most tokens a draw changes and still reads its row narrowed; past it, the draw reads
/// its whole row. A pick moves 12 bytes over the link and costs the host a few times what a
/// whole row's token costs it, so past a few thousand (of Llama 3's 128,256 tokens) the
/// whole row costs little more.
pub const PICKS_MAX: usize = 4096;

impl Sampler {
    /// Whether the draw changes logits: a penalty, or a bias.
    pub(super) fn adjusts(&self) -> bool {
        self.params.penalizes() || !self.bias.is_empty()
    }

    /// The bias added to token `t`'s logit (0: none).
    fn bias_of(&self, t: u32) -> f32 {
        (self.bias.binary_search_by_key(&t, |&(u, _)| u)).map_or(0.0, |i| self.bias[i].1)
    }

    /// Token `t`'s logit `x` with the sample's penalties taken and its bias added: the
    /// repetition penalty, then the frequency and presence penalties, in the order other
    /// OpenAI-compatible servers take them, then the bias.
    pub(super) fn adjust(&self, t: u32, mut x: f32) -> f32 {
        let p = self.params;
        let drawn = self.drawn.get(&t).copied().unwrap_or(0);
        if p.repetition_penalty != 1.0 && (drawn > 0 || self.prompt.contains(&t)) {
            x = if x > 0.0 {
                x / p.repetition_penalty
            } else {
                x * p.repetition_penalty
            };
        }
        if drawn > 0 {
            x -= p.frequency_penalty * drawn as f32 + p.presence_penalty;
        }
        x + self.bias_of(t)
    }

    /// Whether the change may lift token `t`'s logit.
    fn may_lift(&self, t: u32) -> bool {
        let p = self.params;
        let drawn = self.drawn.get(&t).copied().unwrap_or(0);
        let repeated = drawn > 0 || self.prompt.contains(&t);
        (repeated && p.repetition_penalty < 1.0)
            || (drawn > 0 && p.frequency_penalty * drawn as f32 + p.presence_penalty < 0.0)
            || self.bias_of(t) > 0.0
    }

    /// The tokens whose logits this sampler's next draw reads beside its narrowed row
    /// ([`canopy_engine::LayerOps::pick_logits`]), in order: every token it changes, for a
    /// draw over the whole vocabulary (its total needs them), else those the change may lift.
    /// None for a draw that changes nothing, or that reads its whole row.
    pub fn picks(&self) -> Vec<u32> {
        if !self.adjusts() || self.changed.len() > PICKS_MAX {
            return Vec::new();
        }
        match self.params.draws_by_total() {
            true => self.changed.clone(),
            false => (self.changed.iter().copied())
                .filter(|&t| self.may_lift(t))
                .collect(),
        }
    }

    /// [`Sampler::reach`] of a draw that changes logits, of `k` tokens unchanged: a draw by
    /// total walks a head of [`BY_TOTAL_HEAD`] at most, the others reach up to what a backend
    /// narrows to.
    pub(super) fn adjusted_reach(&self, k: usize) -> Option<usize> {
        let most = match self.params.draws_by_total() {
            true => BY_TOTAL_HEAD,
            false => TOP_LOGITS_MAX,
        };
        (self.changed.len() <= PICKS_MAX).then(|| (k + self.changed.len()).min(most))
    }

    /// Whether the draw may change token `t`'s logit.
    fn changes(&self, t: u32) -> bool {
        self.changed.binary_search(&t).is_ok()
    }

    /// The changed tokens past `head`, by token id, with their changed logits (`logit`; `None`:
    /// past the row).
    fn changed_past(&self, head: &[u32], logit: impl Fn(u32) -> Option<f32>) -> Vec<(u32, f32)> {
        let mut head = head.to_vec();
        head.sort_unstable();
        (self.changed.iter())
            .filter(|t| head.binary_search(t).is_err())
            .filter_map(|&t| logit(t).map(|x| (t, x)))
            .collect()
    }

    /// How many of `tokens` the draw changes.
    fn changed_among(&self, tokens: &[u32]) -> usize {
        tokens.iter().filter(|&&t| self.changes(t)).count()
    }

    /// [`Sampler::sample`] of a draw that changes logits.
    pub(super) fn sample_adjusted(&mut self, row: RowLogits, total: Option<f32>) -> Option<u32> {
        let by_total = self.params.draws_by_total();
        match row {
            RowLogits::Whole(raw) => {
                let adjusted = self.adjusted(raw);
                if !by_total {
                    return Some(self.sample_row(RowLogits::Whole(&adjusted)));
                }
                // The narrowing a backend would give, and the walk's head as from it.
                let narrowed = top_tokens(raw, BY_TOTAL_HEAD);
                let want = head_len(narrowed.len(), self.changed_among(&narrowed));
                let head = top_tokens(&adjusted, want);
                let logits: Vec<f32> = head.iter().map(|&t| adjusted[t as usize]).collect();
                let changed =
                    (self.changed.iter()).filter_map(|&t| raw.get(t as usize).map(|&x| (t, x)));
                let unchanged_max = match narrowed.iter().find(|&&t| !self.changes(t)) {
                    Some(&t) => raw[t as usize],
                    None => (raw.iter().enumerate())
                        .filter(|&(t, _)| !self.changes(t as u32))
                        .fold(f32::NEG_INFINITY, |m, (_, &x)| m.max(x)),
                };
                let from_backend =
                    total.and_then(|z| self.changed_total(z, unchanged_max, logits[0], changed));
                let total = from_backend
                    .unwrap_or_else(|| softmax_total(&adjusted, self.params.temperature).into());
                let changed = self.changed_past(&head, |t| adjusted.get(t as usize).copied());
                self.walk_by_total(ByTotal {
                    head: (&head, &logits),
                    changed: &changed,
                    total,
                    whole: Some(&adjusted),
                    whole_head: true,
                })
            }
            RowLogits::Top {
                tokens,
                logits,
                picked,
            } => {
                let n = match by_total {
                    true => tokens.len().min(BY_TOTAL_HEAD),
                    false => tokens.len(),
                };
                let c = self.changed_among(&tokens[..n]);
                let want = match by_total {
                    true => head_len(n, c),
                    false => self.params.reach()?,
                };
                if want + c > n {
                    return None;
                }
                // The row as the model left it, where it was read, by token id.
                let mut raw: Vec<(u32, f32)> = (tokens[..n].iter().copied())
                    .zip(logits[..n].iter().copied())
                    .chain(picked.iter().copied())
                    .collect();
                raw.sort_unstable_by_key(|&(t, _)| t);
                raw.dedup_by_key(|&mut (t, _)| t);
                let raw_of = |t: u32| {
                    (raw.binary_search_by_key(&t, |&(u, _)| u))
                        .ok()
                        .map(|i| raw[i].1)
                };
                // Only the changed tokens' logits change; both lists are by token id.
                let mut changes = self.changed.iter().peekable();
                let mut head: Vec<(u32, f32)> = (raw.iter())
                    .map(|&(t, x)| {
                        while changes.next_if(|&&c| c < t).is_some() {}
                        match changes.peek() == Some(&&t) {
                            true => (t, self.adjust(t, x)),
                            false => (t, x),
                        }
                    })
                    .collect();
                let order = |&(a, x): &(u32, f32), &(b, y): &(u32, f32)| likelier(a, x, b, y);
                if head.len() > want {
                    head.select_nth_unstable_by(want, order);
                    head.truncate(want);
                }
                head.sort_unstable_by(order);
                let (head, head_logits): (Vec<u32>, Vec<f32>) = head.into_iter().unzip();
                if !by_total {
                    return Some(self.sample_row(RowLogits::Top {
                        tokens: &head,
                        logits: &head_logits,
                        picked: &[],
                    }));
                }
                let changed = (self.changed.iter()).filter_map(|&t| raw_of(t).map(|x| (t, x)));
                // The likeliest unchanged token is narrowed: `c < n` here.
                let unchanged = tokens[..n].iter().position(|&t| !self.changes(t))?;
                let unchanged_max = logits[unchanged];
                let total = self.changed_total(total?, unchanged_max, head_logits[0], changed)?;
                let changed = self.changed_past(&head, |t| raw_of(t).map(|x| self.adjust(t, x)));
                self.walk_by_total(ByTotal {
                    head: (&head, &head_logits),
                    changed: &changed,
                    total,
                    whole: None,
                    whole_head: n == BY_TOTAL_HEAD,
                })
            }
        }
    }

    /// The changed row's softmax total at the sampler's temperature, its terms relative to
    /// `max` (the changed row's largest logit): the backend's `unchanged` total (of the tokens
    /// the draw leaves as they are, relative to the largest of them, `unchanged_max`) and the
    /// `changed` tokens' terms after the change, from their logits before it. `None` where the
    /// sum is no positive number (no token left unchanged, or one that overflows).
    fn changed_total(
        &self,
        unchanged: f32,
        unchanged_max: f32,
        max: f32,
        changed: impl Iterator<Item = (u32, f32)>,
    ) -> Option<f64> {
        let temperature = self.params.temperature;
        let term = |x: f32| (((x - max) / temperature) as f64).exp();
        let changed: f64 = changed.map(|(t, x)| term(self.adjust(t, x))).sum();
        let total = f64::from(unchanged) * term(unchanged_max) + changed;
        (total.is_finite() && total > 0.0).then_some(total)
    }

    /// A whole row with the changed tokens' logits changed ([`Sampler::adjust`]); tokens past
    /// the row change nothing.
    fn adjusted(&self, logits: &[f32]) -> Vec<f32> {
        let mut row = logits.to_vec();
        for &t in &self.changed {
            if let Some(x) = row.get_mut(t as usize) {
                *x = self.adjust(t, *x);
            }
        }
        row
    }
}

/// The changed row's likeliest that a draw by total walks in order, of a narrowing of `n`
/// tokens, `c` of them changed: enough that they are known from the narrowed and the picked
/// tokens, at least one.
fn head_len(n: usize, c: usize) -> usize {
    n.saturating_sub(c).max(1)
}

#[cfg(test)]
mod tests {
    use super::super::tests::{narrowed, spread_row, walk_on_cpu};
    use super::super::{SamplingParams, StepLogits};
    use super::*;
    use canopy_engine::{CpuBackend, LayerOps};

    /// A row's softmax total at `s`'s temperature without the tokens `s` picks, as a step
    /// reads it.
    fn total(s: &Sampler, logits: &[f32]) -> Option<f32> {
        let temperature = s.total_temperature()?;
        let b = CpuBackend;
        let mut row = b.upload_tensor(logits, 1, logits.len()).unwrap();
        let places: Vec<(u32, u32)> = (s.picks().into_iter())
            .filter(|&t| (t as usize) < logits.len())
            .map(|t| (0, t))
            .collect();
        b.set_logits(&mut row, &places, f32::NEG_INFINITY).unwrap();
        let mut out = b.tensor(1, 1).unwrap();
        (b.softmax_totals(&row, &[temperature], &mut out)).unwrap();
        Some(out.data[0])
    }

    /// `logits` narrowed to `k` tokens, with the logits of `s`'s picks beside them, as a
    /// step reads them.
    fn narrowed_for(s: &Sampler, logits: &[f32], k: usize) -> StepLogits {
        let mut step = narrowed(logits, k);
        let picks: Vec<(u32, f32)> = (s.picks().into_iter())
            .filter_map(|t| logits.get(t as usize).map(|&x| (t, x)))
            .collect();
        if let StepLogits::Top { picked, .. } = &mut step {
            picked.insert(0, picks);
        }
        step
    }

    /// Where a draw settled.
    #[derive(Debug, Clone, Copy, PartialEq)]
    enum Settled {
        Narrowed,
        /// Over the rest of the row, on the backend.
        Walked,
        Whole,
    }

    /// A draw from a row narrowed to `k` with its picks, and where the narrowed row does not
    /// settle it, over the rest of the row on the backend (the CPU's) where the sampler can,
    /// else from the whole row.
    fn draw_narrowed(s: &mut Sampler, logits: &[f32], k: usize, z: Option<f32>) -> (u32, Settled) {
        if let Some(t) = s.sample(narrowed_for(s, logits, k).row(0), z) {
            return (t, Settled::Narrowed);
        }
        match walk_on_cpu(s, logits) {
            Some(t) => (t, Settled::Walked),
            None => (
                s.sample(RowLogits::Whole(logits), z).unwrap(),
                Settled::Whole,
            ),
        }
    }

    proptest::proptest! {
        /// A draw that changes logits (penalties and biases of either sign), from a row
        /// narrowed to its reach or more with its picks beside it, and from the whole row
        /// where that does not settle it, is the draw from the whole row, step after step:
        /// greedy, cut by `top_k` (a few, or past the 128 a draw by total walks), or over the
        /// whole vocabulary by the backend's total, on rows with many ties, changing up to
        /// hundreds of tokens.
        #[test]
        fn a_changing_draw_from_its_narrowed_row_is_the_whole_rows(
            seed in 0u64..1000,
            kind in 0usize..3,
            top_k in proptest::prop_oneof![1usize..6, 129usize..260],
            top_p in proptest::prop_oneof![proptest::strategy::Just(1.0f32), 0.5f32..1.0],
            frequency in -1.0f32..1.5,
            presence in -1.0f32..1.5,
            repetition in 0.7f32..2.0,
            prompt in proptest::collection::vec(0u32..300, 0..200),
            bias in proptest::collection::vec((0u32..300, -6.0f32..6.0), 0..4),
            vocab in 60usize..300,
            extra in 0usize..40,
        ) {
            let (temperature, top_k) = match kind {
                0 => (0.0, 0),
                1 => (0.9, top_k),
                _ => (0.3 + (seed % 12) as f32 * 0.1, 0),
            };
            let params = SamplingParams {
                temperature,
                top_k,
                top_p,
                frequency_penalty: frequency,
                presence_penalty: presence,
                repetition_penalty: repetition,
            };
            let mut bias = bias;
            bias.sort_unstable_by_key(|&(t, _)| t);
            bias.dedup_by_key(|&mut (t, _)| t);
            let (mut whole, mut narrow) = (
                Sampler::new(params, seed, &prompt).with_bias(&bias),
                Sampler::new(params, seed, &prompt).with_bias(&bias),
            );
            for step in 0..12u64 {
                let logits: Vec<f32> = (0..vocab as u64)
                    .map(|i| ((i * 7 + step * 13 + seed) % 9) as f32 * 0.5)
                    .collect();
                let z = total(&whole, &logits);
                let k = narrow.reach().expect("few tokens changed");
                let a = whole.sample(RowLogits::Whole(&logits), z).unwrap();
                let (b, _) = draw_narrowed(&mut narrow, &logits, (k + extra).min(vocab), z);
                proptest::prop_assert_eq!(a, b, "step {}, reach {}", step, k);
            }
        }
    }

    /// Draws over the whole vocabulary with biases that lift a token from far down the row
    /// and lower the likeliest land on each token as often as the changed row's softmax says,
    /// mostly from narrowed rows.
    #[test]
    fn changed_draws_by_total_follow_the_changed_softmax() {
        let logits: Vec<f32> = (0..2000).map(|i| -(i as f32) * 0.01).collect();
        let bias = [(0, -1.5), (3, 0.5), (1500, 14.5)];
        let temperature = 0.9;
        let mut changed = logits.clone();
        bias.iter().for_each(|&(t, b)| changed[t as usize] += b);
        let max = changed.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let terms: Vec<f64> = (changed.iter())
            .map(|&x| (f64::from(x - max) / f64::from(temperature)).exp())
            .collect();
        let sum: f64 = terms.iter().sum();
        let params = SamplingParams {
            temperature,
            ..SamplingParams::default()
        };
        let mut s = Sampler::new(params, 3, &[]).with_bias(&bias);
        let z = total(&s, &logits);
        let (draws, mut counts, mut walked) = (40_000, vec![0usize; logits.len()], 0);
        for _ in 0..draws {
            let (t, settled) = draw_narrowed(&mut s, &logits, BY_TOTAL_HEAD, z);
            counts[t as usize] += 1;
            assert_ne!(settled, Settled::Whole);
            walked += usize::from(settled == Settled::Walked);
        }
        for t in [0, 1, 2, 3, 50, 127, 128, 1500, 1999] {
            let want = terms[t] / sum;
            let seen = counts[t] as f64 / draws as f64;
            // Five standard deviations of a binomial share.
            let bound = 5.0 * (want * (1.0 - want) / draws as f64).sqrt() + 1e-4;
            assert!((seen - want).abs() < bound, "token {t}: {seen}, not {want}");
        }
        // The changed row's 126 likeliest (two of the changed tokens are among the row's 128)
        // and its lifted token hold all but this share of its mass; the rest is walked on the
        // backend.
        let mut sorted = terms.clone();
        sorted[1500] = 0.0;
        sorted.sort_by(|a, b| b.total_cmp(a));
        let past = 1.0 - (sorted[..BY_TOTAL_HEAD - 2].iter().sum::<f64>() + terms[1500]) / sum;
        let seen = walked as f64 / draws as f64;
        assert!(
            (seen - past).abs() < 0.01,
            "{seen} walked on the backend, not {past}"
        );
    }

    /// A penalised draw over the whole vocabulary cut by `top_p` past its head, whose penalised
    /// tokens lie past the head too, walks the rest of its row on the backend with their
    /// changed logits in place: it reads no row whole, and draws what the whole row draws.
    #[test]
    fn a_penalised_cut_past_the_head_walks_on_the_backend() {
        let logits = spread_row(5, 3000, 2.0);
        let params = SamplingParams {
            temperature: 1.0,
            top_p: 0.9,
            frequency_penalty: 0.8,
            presence_penalty: 0.4,
            ..SamplingParams::default()
        };
        let (mut whole, mut narrow) = (Sampler::new(params, 9, &[]), Sampler::new(params, 9, &[]));
        let mut walked_changed = 0;
        for draw in 0..60 {
            let z = total(&whole, &logits);
            let a = whole.sample(RowLogits::Whole(&logits), z).unwrap();
            let k = narrow.reach().unwrap();
            let (b, settled) = draw_narrowed(&mut narrow, &logits, k, z);
            assert_eq!(a, b, "draw {draw}");
            assert_ne!(settled, Settled::Whole, "draw {draw}");
            walked_changed += usize::from(settled == Settled::Walked && !narrow.changed.is_empty());
        }
        assert!(
            walked_changed > 10,
            "{walked_changed} penalised walks on the backend"
        );
    }

    /// A change that takes nearly all of a row's mass (a bias that bars the token that held
    /// it) leaves the changed total as exact as the backend's: the draw still settles on its
    /// narrowed row as often as the head it walks weighs, and never lands on the barred token.
    #[test]
    fn a_change_that_takes_most_of_the_mass_still_draws_from_the_narrowed_row() {
        let mut logits = vec![0.0f32; 200];
        logits[7] = 12.0;
        let params = SamplingParams {
            temperature: 1.0,
            ..SamplingParams::default()
        };
        let mut s = Sampler::new(params, 1, &[]).with_bias(&[(7, -40.0)]);
        let z = total(&s, &logits);
        let (draws, mut narrowed_draws) = (4000, 0);
        for _ in 0..draws {
            let (t, settled) = draw_narrowed(&mut s, &logits, BY_TOTAL_HEAD, z);
            assert_ne!(t, 7);
            narrowed_draws += usize::from(settled != Settled::Whole);
        }
        assert_eq!(
            narrowed_draws, draws,
            "the rest of the row walked on the backend"
        );
    }
}
