//! Draws at a temperature over the whole vocabulary by their row's softmax total, summed on
//! the backend ([`canopy_engine::LayerOps::softmax_totals`]): the walk over a row's likeliest
//! tokens, in order, then over the rest of the row by token id ([`Sampler::sample`]).

use super::{RowLogits, Sampler};
use canopy_core::logits::top_tokens;
use canopy_engine::TOP_LOGITS_MAX;
use rand::Rng;

/// The likeliest tokens of a row a draw by total walks in order before the rest: as many as a
/// backend narrows a row to.
const BY_TOTAL_HEAD: usize = TOP_LOGITS_MAX;

impl Sampler {
    /// A draw by total ([`Sampler::sample`]), from a row narrowed or whole.
    pub(super) fn sample_by_total(&mut self, row: RowLogits, total: f32) -> Option<u32> {
        let u = match self.pending.take() {
            Some(u) => u,
            None => self.rng.gen::<f64>(),
        };
        let drawn = match row {
            RowLogits::Top { tokens, logits } => {
                let n = tokens.len().min(BY_TOTAL_HEAD);
                self.by_total(u, (&tokens[..n], &logits[..n]), total, None)
            }
            RowLogits::Whole(row) => {
                let head = top_tokens(row, BY_TOTAL_HEAD);
                let logits: Vec<f32> = head.iter().map(|&t| row[t as usize]).collect();
                self.by_total(u, (&head, &logits), total, Some(row))
            }
        };
        if drawn.is_none() {
            self.pending = Some(u);
        }
        drawn
    }

    /// Where the uniform `u` lands among a row's tokens, each's probability `exp((logit -
    /// max) / T) / total`: over the `head` (the row's [`BY_TOTAL_HEAD`] likeliest, or all of
    /// them, most likely first, with their logits), then over the rest of the `whole` row by
    /// token id, or in order where `top_p` cuts them. `None`: past the head of a row not given
    /// whole. A walk past every token (the total's rounding) ends at the last it could take.
    fn by_total(
        &self,
        u: f64,
        (head, logits): (&[u32], &[f32]),
        total: f32,
        whole: Option<&[f32]>,
    ) -> Option<u32> {
        let p = self.params;
        let max = *logits.first()?;
        let prob = |x: f32| (((x - max) / p.temperature) as f64).exp() / total as f64;
        let complete = |n: usize| whole.is_some_and(|w| w.len() == n);
        if p.top_p < 1.0 {
            // The cut needs the tokens in order: wider heads of the whole row, until it falls.
            if let Some(t) = self.cut_walk(u, (head, logits), &prob, complete(head.len())) {
                return Some(t);
            }
            let whole = whole?;
            return [16 * BY_TOTAL_HEAD, whole.len()].into_iter().find_map(|k| {
                let tokens = top_tokens(whole, k);
                let logits: Vec<f32> = tokens.iter().map(|&t| whole[t as usize]).collect();
                self.cut_walk(u, (&tokens, &logits), &prob, complete(tokens.len()))
            });
        }
        let mut target = u;
        let mut last = head[0];
        let mut take = |t: u32, x: f32| {
            let q = prob(x);
            if target < q {
                return true;
            }
            target -= q;
            if q > 0.0 {
                last = t;
            }
            false
        };
        if let Some(&t) = (head.iter().zip(logits)).find_map(|(t, &x)| take(*t, x).then_some(t)) {
            return Some(t);
        }
        let whole = whole?;
        let mut in_head = vec![false; whole.len()];
        head.iter().for_each(|&t| in_head[t as usize] = true);
        let past = (0..whole.len() as u32)
            .filter(|&t| !in_head[t as usize])
            .find(|&t| take(t, whole[t as usize]));
        Some(past.unwrap_or(last))
    }

    /// `u`'s draw among the smallest head of `tokens` (most likely first, with their
    /// `logits`) whose probability (`prob`) reaches `top_p`. `None`: the head is not among
    /// them, unless they are `complete`; then the draw is among them all.
    fn cut_walk(
        &self,
        u: f64,
        (tokens, logits): (&[u32], &[f32]),
        prob: &dyn Fn(f32) -> f64,
        complete: bool,
    ) -> Option<u32> {
        let mut acc = 0.0;
        let head = match logits.iter().position(|&x| {
            acc += prob(x);
            acc >= self.params.top_p as f64
        }) {
            Some(i) => i + 1,
            None if complete => tokens.len(),
            None => return None,
        };
        let mut target = u * acc;
        for (&t, &x) in tokens[..head].iter().zip(logits) {
            let q = prob(x);
            if target < q {
                return Some(t);
            }
            target -= q;
        }
        Some(tokens[head - 1])
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::narrowed;
    use super::super::SamplingParams;
    use super::*;

    /// A row's softmax total at `temperature`, as a backend sums it.
    fn total(logits: &[f32], temperature: f32) -> f32 {
        use canopy_engine::LayerOps;
        let b = canopy_engine::CpuBackend;
        let row = b.upload_tensor(logits, 1, logits.len()).unwrap();
        let mut out = b.tensor(1, 1).unwrap();
        b.softmax_totals(&row, &[temperature], &mut out).unwrap();
        out.data[0]
    }

    /// A draw by total from a narrowed row, and from the whole row where it lands past it.
    fn draw_by_total(s: &mut Sampler, logits: &[f32], k: usize, total: f32) -> (u32, bool) {
        match s.sample(narrowed(logits, k).row(0), Some(total)) {
            Some(t) => (t, false),
            None => (
                s.sample(RowLogits::Whole(logits), Some(total)).unwrap(),
                true,
            ),
        }
    }

    proptest::proptest! {
        /// A draw over the whole vocabulary by its row's total is the same from a row
        /// narrowed to any width, read whole where the draw lands past it, as from the whole
        /// row: at any temperature and `top_p`, on rows peaked or flat.
        #[test]
        fn a_draw_by_total_is_the_same_at_every_narrowing(
            seed in 0u64..1000,
            temperature in 0.2f32..2.0,
            top_p in proptest::prop_oneof![proptest::strategy::Just(1.0f32), 0.3f32..1.0],
            spread in 0.5f32..12.0,
            vocab in 10usize..3000,
            k in 1usize..=TOP_LOGITS_MAX,
        ) {
            let params = SamplingParams { temperature, top_p, ..SamplingParams::default() };
            let logits: Vec<f32> = (0..vocab as u64)
                .map(|i| ((i * 7919 + seed * 31) % 997) as f32 / 997.0 * spread)
                .collect();
            let z = total(&logits, temperature);
            let (mut whole, mut narrow) = (Sampler::new(params, seed, &[]), Sampler::new(params, seed, &[]));
            proptest::prop_assert_eq!(whole.total_temperature(), Some(temperature));
            for draw in 0..8 {
                let a = whole.sample(RowLogits::Whole(&logits), Some(z)).unwrap();
                let (b, _) = draw_by_total(&mut narrow, &logits, k.min(vocab), z);
                proptest::prop_assert_eq!(a, b, "draw {}, narrowed to {}", draw, k);
            }
        }
    }

    /// Draws by total land on each token as often as its probability says, and past a narrow
    /// row as often as the tokens past it weigh.
    #[test]
    fn draws_by_total_follow_the_softmax() {
        let logits: Vec<f32> = (0..200).map(|i| -(i as f32) * 0.05).collect();
        let temperature = 0.8;
        let params = SamplingParams {
            temperature,
            ..SamplingParams::default()
        };
        let z = total(&logits, temperature);
        let prob = |t: usize| (f64::from(logits[t] - logits[0]) / 0.8).exp() / f64::from(z);
        let (k, draws) = (16, 40_000);
        let mut s = Sampler::new(params, 5, &[]);
        let mut counts = vec![0usize; logits.len()];
        let mut past = 0;
        for _ in 0..draws {
            let (t, short) = draw_by_total(&mut s, &logits, k, z);
            counts[t as usize] += 1;
            past += usize::from(short);
        }
        let past_mass: f64 = (k..logits.len()).map(prob).sum();
        let seen = past as f64 / draws as f64;
        assert!(
            (seen - past_mass).abs() < 0.015,
            "{seen} past the row against {past_mass}"
        );
        for t in [0, 1, 5, 15, 16, 40, 100] {
            let seen = counts[t] as f64 / draws as f64;
            // Five standard deviations of a binomial share.
            let bound = 5.0 * (prob(t) * (1.0 - prob(t)) / draws as f64).sqrt() + 1e-4;
            assert!(
                (seen - prob(t)).abs() < bound,
                "token {t}: {seen} against {}",
                prob(t)
            );
        }
    }

    #[test]
    fn only_unchanged_draws_over_the_whole_vocabulary_read_totals() {
        let at = |temperature, top_k| SamplingParams {
            temperature,
            top_k,
            ..SamplingParams::default()
        };
        assert_eq!(
            Sampler::new(at(0.7, 0), 0, &[]).total_temperature(),
            Some(0.7)
        );
        assert_eq!(
            Sampler::new(at(0.7, 0), 0, &[]).reach(),
            Some(TOP_LOGITS_MAX)
        );
        assert_eq!(Sampler::new(at(0.0, 0), 0, &[]).total_temperature(), None);
        assert_eq!(Sampler::new(at(0.7, 40), 0, &[]).total_temperature(), None);
        // A penalty or a bias changes the row its total was summed over.
        let penalised = SamplingParams {
            presence_penalty: 0.5,
            ..at(0.7, 0)
        };
        assert_eq!(Sampler::new(penalised, 0, &[]).total_temperature(), None);
        assert_eq!(Sampler::new(penalised, 0, &[]).reach(), None);
        let biased = Sampler::new(at(0.7, 0), 0, &[]).with_bias(&[(3, -1.0)]);
        assert_eq!((biased.total_temperature(), biased.reach()), (None, None));
    }
}
