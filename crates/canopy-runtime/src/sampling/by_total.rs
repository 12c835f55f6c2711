//! Draws at a temperature over the whole vocabulary by their row's softmax total, summed on
//! the backend ([`canopy_engine::LayerOps::softmax_totals`]): the walk over a row's likeliest
//! tokens, in order, then over the rest of the row by token id ([`Sampler::sample`]), on the
//! host or on the backend ([`Sampler::tail_walk`]).

use super::{RowLogits, Sampler};
use canopy_core::logits::{top_tokens, TailCut, TailWalk};
use rand::Rng;

/// The likeliest tokens of a row a draw by total walks in order before the rest, which the
/// backend narrows its row to: the head's walk on the host and its download grow with it,
/// and past it most draws of a trained model's rows have landed (the rest are walked on the
/// backend).
pub(super) const BY_TOTAL_HEAD: usize = 128;

impl Sampler {
    /// A draw by total ([`Sampler::sample`]), from a row narrowed or whole.
    pub(super) fn sample_by_total(&mut self, row: RowLogits, total: f32) -> Option<u32> {
        match row {
            RowLogits::Top { tokens, logits, .. } => {
                let n = tokens.len().min(BY_TOTAL_HEAD);
                self.walk_by_total(ByTotal {
                    head: (&tokens[..n], &logits[..n]),
                    changed: &[],
                    total: total.into(),
                    whole: None,
                    whole_head: n == BY_TOTAL_HEAD,
                })
            }
            RowLogits::Whole(row) => {
                let head = top_tokens(row, BY_TOTAL_HEAD);
                let logits: Vec<f32> = head.iter().map(|&t| row[t as usize]).collect();
                self.walk_by_total(ByTotal {
                    head: (&head, &logits),
                    changed: &[],
                    total: total.into(),
                    whole: Some(row),
                    whole_head: true,
                })
            }
        }
    }

    /// The walk of a draw by total ([`Sampler::by_total`]), with the draw's uniform number:
    /// the one kept from a walk that landed past its narrowed row, or a new one.
    pub(super) fn walk_by_total(&mut self, walk: ByTotal) -> Option<u32> {
        let u = match self.pending.take() {
            Some(pending) => pending.u,
            None => self.rng.gen::<f64>(),
        };
        let tail = match self.by_total(u, &walk) {
            Walked::On(t) => return Some(t),
            // The rest of the row as the whole row's walk takes it.
            Walked::Tail { rest, last } if walk.whole_head => Some((rest, last)),
            Walked::Tail { .. } | Walked::Whole => None,
        };
        self.pending = Some(Pending { u, tail });
        None
    }

    /// The rest of this sampler's draw that landed past its narrowed row, where a backend may
    /// walk it over the row ([`canopy_engine::LayerOps::walk_tails`]) instead of reading the
    /// row whole (with a changing draw's logits in place of the model's); `None` where the
    /// draw needs its whole row (its head is not the one the whole row's walk takes).
    pub fn tail_walk(&self) -> Option<&TailWalk> {
        self.pending.as_ref()?.tail.as_ref().map(|(walk, _)| walk)
    }

    /// Finishes the draw whose [`Sampler::tail_walk`] a backend walked, with where it
    /// `landed` (`None`: no token past the head has a probability above 0); the token drawn.
    pub fn land_tail(&mut self, landed: Option<u32>) -> Option<u32> {
        let (_, last) = self.pending.take()?.tail?;
        let token = landed.unwrap_or(last);
        self.record(token);
        Some(token)
    }

    /// The logits a cut walk past the `head` reads in place of the model's, by token id: for
    /// a draw that changes logits, the head's (which its walk in order reads) and the changed
    /// tokens' past it, as the draw takes them; none for one that changes nothing.
    fn in_place(
        &self,
        (head, logits): (&[u32], &[f32]),
        changed: &[(u32, f32)],
    ) -> Vec<(u32, f32)> {
        if !self.adjusts() {
            return Vec::new();
        }
        let mut in_place: Vec<(u32, f32)> = (head.iter().copied().zip(logits.iter().copied()))
            .chain(changed.iter().copied())
            .collect();
        in_place.sort_unstable_by_key(|&(t, _)| t);
        in_place
    }

    /// Where the uniform `u` lands among a row's tokens, each's probability `exp((logit -
    /// max) / T) / total`: over the `head` (the row's [`BY_TOTAL_HEAD`] likeliest, or all of
    /// them, most likely first, with their logits), then over the rest of the `whole` row by
    /// token id. A `top_p` that cuts the head, summed in order as over a narrowed row, keeps
    /// the draw in it; one past the head keeps the fewest likeliest of the rest that reach it,
    /// found by selection, not a sort ([`land_between`] where the row is not given whole).
    /// Past the head of a row not given whole, the walk goes on over the rest of the row
    /// ([`Walked::Tail`], with its `top_p` cut where [`land_between`] does not settle it, and
    /// the changed tokens' logits in place). A walk past every token it may take (the total's
    /// rounding) ends at the last it took a step over.
    fn by_total(&self, u: f64, walk: &ByTotal) -> Walked {
        let ByTotal {
            head: (head, logits),
            changed,
            total,
            whole,
            ..
        } = *walk;
        let p = self.params;
        let Some(&max) = logits.first() else {
            return Walked::Whole;
        };
        let prob = |x: f32| (((x - max) / p.temperature) as f64).exp() / total;
        let (mut head_len, mut target, mut past_head) = (head.len(), u, true);
        let mut acc = 0.0;
        if p.top_p < 1.0 {
            if let Some(i) = logits.iter().position(|&x| {
                acc += prob(x);
                acc >= p.top_p as f64
            }) {
                (head_len, past_head) = (i + 1, false);
            }
            target = u * acc;
        }
        // A `top_p` cut past the head keeps the fewest likeliest of the rest that reach it,
        // which set the draw's scale: walked over the whole row, or on the backend with the
        // changed tokens' logits in place of the model's.
        if past_head && p.top_p < 1.0 {
            let rest = TailWalk {
                head: head.to_vec(),
                max,
                temperature: p.temperature,
                total,
                target: 0.0,
                cut: Some(TailCut {
                    u,
                    top_p: p.top_p as f64,
                    head_mass: acc,
                }),
                changed: vec![],
            };
            let Some(whole) = whole else {
                let Some(t) = land_between(u, (head, logits), &prob, p.top_p as f64) else {
                    return Walked::Tail {
                        rest: TailWalk {
                            changed: self.in_place((head, logits), changed),
                            ..rest
                        },
                        last: head[0],
                    };
                };
                return Walked::On(t);
            };
            return Walked::On(rest.land(whole).unwrap_or(head[0]));
        }
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
        if let Some(&t) =
            (head[..head_len].iter().zip(logits)).find_map(|(t, &x)| take(*t, x).then_some(t))
        {
            return Walked::On(t);
        }
        if !past_head {
            return Walked::On(last);
        }
        // Past the head: the changed tokens, then the rest by token id.
        if let Some(&(t, _)) = changed.iter().find(|&&(t, x)| take(t, x)) {
            return Walked::On(t);
        }
        // The rest of the row: the head and the changed tokens left out.
        let mut head = head.to_vec();
        head.extend(changed.iter().map(|&(t, _)| t));
        let rest = TailWalk {
            head,
            max,
            temperature: p.temperature,
            total,
            target,
            cut: None,
            changed: vec![],
        };
        match whole {
            Some(whole) => Walked::On(rest.land(whole).unwrap_or(last)),
            None => Walked::Tail { rest, last },
        }
    }
}

/// What a draw by total walks, in this order: a row's `head` (its likeliest, most likely
/// first, with their logits), the tokens past the head whose logits the draw changes (by
/// token id, with their changed logits), then the rest of the row by token id, from the
/// `whole` row where it was read (else on the backend, [`Sampler::tail_walk`]); each token's
/// probability its term over the row's `total`.
pub(super) struct ByTotal<'a> {
    pub head: (&'a [u32], &'a [f32]),
    pub changed: &'a [(u32, f32)],
    pub total: f64,
    pub whole: Option<&'a [f32]>,
    /// Whether the head is the one the walk over the whole row takes (a narrowing of
    /// [`BY_TOTAL_HEAD`] tokens), so that a backend may walk the rest of the row.
    pub whole_head: bool,
}

/// Where a draw by total's walk over a row's head came to.
enum Walked {
    On(u32),
    /// Past the head and the changed tokens: the `rest` of the row to walk, or the `last`
    /// token walked with a probability above 0 where no token in the rest has one.
    Tail {
        rest: TailWalk,
        last: u32,
    },
    /// A row narrowed to no tokens: only the whole row settles the draw.
    Whole,
}

/// A draw by total that landed past its narrowed row: its uniform number, and the rest of its
/// walk with the head's last token, where a backend may take it.
pub(super) struct Pending {
    u: f64,
    tail: Option<(TailWalk, u32)>,
}

/// The head token a draw cut by `top_p` past the `head` lands on wherever the cut falls, if
/// one does (`None`: it depends on the rest of the row). The tokens kept weigh `top_p` at
/// least, and less than `top_p` and the head's last token's probability (no token past the
/// head weighs more), so the draw's target lies between `u` times each. Where the walk of
/// both ends over the head lands on one token, the walk of the target does too: the walks
/// take the same steps, and each step keeps the targets in order.
fn land_between(
    u: f64,
    (head, logits): (&[u32], &[f32]),
    prob: &dyn Fn(f32) -> f64,
    top_p: f64,
) -> Option<u32> {
    // Room for the kept mass's rounding, summed in another order.
    const SLACK: f64 = 1e-12;
    let land = |mut target: f64| {
        for (&t, &x) in head.iter().zip(logits) {
            let q = prob(x);
            if target < q {
                return Some(t);
            }
            target -= q;
        }
        None
    };
    let last = prob(*logits.last()?);
    let low = land(u * top_p * (1.0 - SLACK))?;
    (land(u * (top_p + last) * (1.0 + SLACK)) == Some(low)).then_some(low)
}

#[cfg(test)]
mod tests {
    use super::super::tests::{narrowed, spread_row, walk_on_cpu};
    use super::super::SamplingParams;
    use super::*;
    use canopy_engine::TOP_LOGITS_MAX;

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
            let logits = spread_row(seed, vocab, spread);
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

    proptest::proptest! {
        /// A draw that lands past its row narrowed to [`BY_TOTAL_HEAD`] tokens and goes on
        /// over the rest of the row on the backend ([`Sampler::tail_walk`]), with a `top_p`
        /// cut past the head or none, draws what the whole row draws.
        #[test]
        fn a_tail_walked_on_the_backend_is_the_whole_rows(
            seed in 0u64..1000,
            temperature in 0.5f32..2.0,
            top_p in proptest::prop_oneof![proptest::strategy::Just(1.0f32), 0.3f32..1.0],
            spread in 0.5f32..4.0,
            vocab in 130usize..3000,
        ) {
            let params = SamplingParams { temperature, top_p, ..SamplingParams::default() };
            let logits = spread_row(seed, vocab, spread);
            let z = total(&logits, temperature);
            let (mut whole, mut narrow) = (Sampler::new(params, seed, &[]), Sampler::new(params, seed, &[]));
            for draw in 0..8 {
                let a = whole.sample(RowLogits::Whole(&logits), Some(z)).unwrap();
                let b = match narrow.sample(narrowed(&logits, BY_TOTAL_HEAD).row(0), Some(z)) {
                    Some(t) => t,
                    None => walk_on_cpu(&mut narrow, &logits).expect("an unchanged row"),
                };
                proptest::prop_assert_eq!(a, b, "draw {}", draw);
            }
        }
    }

    /// Draws by total land on each token as often as its probability says (within the
    /// smallest head that reaches `top_p`, renormalised), and past a narrow row as often as
    /// the tokens past it weigh.
    #[test]
    fn draws_by_total_follow_the_softmax() {
        // Ties, which the order breaks by token id, and a cut at top_p 0.8 past the 128
        // likeliest.
        let logits: Vec<f32> = (0..2000).map(|i| -((i / 2) as f32) * 0.01).collect();
        let temperature = 0.8;
        let z = total(&logits, temperature);
        let prob = |t: usize| (f64::from(logits[t] - logits[0]) / 0.8).exp() / f64::from(z);
        for top_p in [1.0, 0.8] {
            let params = SamplingParams {
                temperature,
                top_p,
                ..SamplingParams::default()
            };
            // The smallest head that reaches top_p, and its mass.
            let mut mass = 0.0;
            let head = (0..logits.len())
                .position(|t| {
                    mass += prob(t);
                    mass >= f64::from(top_p)
                })
                .map_or(logits.len(), |i| i + 1);
            let want = |t: usize| if t < head { prob(t) / mass } else { 0.0 };
            let (k, draws) = (16, 40_000);
            let mut s = Sampler::new(params, 5, &[]);
            let mut counts = vec![0usize; logits.len()];
            let mut past = 0;
            for _ in 0..draws {
                let (t, short) = draw_by_total(&mut s, &logits, k, z);
                counts[t as usize] += 1;
                past += usize::from(short);
            }
            // A draw reads its row whole where it lands past the narrowed tokens, also where
            // its cut lies past the whole row's head.
            assert!(top_p == 1.0 || head > BY_TOTAL_HEAD);
            let past_share = 1.0 - (0..k).map(prob).sum::<f64>() / mass;
            let seen = past as f64 / draws as f64;
            assert!(
                (seen - past_share).abs() < 0.015,
                "top_p {top_p}: {seen} past the row, not {past_share}"
            );
            let tokens = [0, 1, 5, 15, 16, 40, 127, 128, head - 1, head, 1500];
            for t in tokens.into_iter().filter(|&t| t < logits.len()) {
                let seen = counts[t] as f64 / draws as f64;
                // Five standard deviations of a binomial share.
                let bound = 5.0 * (want(t) * (1.0 - want(t)) / draws as f64).sqrt() + 1e-4;
                assert!(
                    (seen - want(t)).abs() < bound,
                    "top_p {top_p}, token {t}: {seen}, not {}",
                    want(t)
                );
            }
        }
    }

    #[test]
    fn draws_over_the_whole_vocabulary_read_totals() {
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
            Some(BY_TOTAL_HEAD)
        );
        assert_eq!(Sampler::new(at(0.0, 0), 0, &[]).total_temperature(), None);
        assert_eq!(Sampler::new(at(0.7, 40), 0, &[]).total_temperature(), None);
        // A draw that changes logits reads the total too, and picks every token it changes,
        // lowered or lifted: the changed total needs them.
        let penalised = SamplingParams {
            repetition_penalty: 1.3,
            ..at(0.7, 0)
        };
        let s = Sampler::new(penalised, 0, &[9, 4, 9]).with_bias(&[(3, -1.0), (700, 2.0)]);
        assert_eq!(s.total_temperature(), Some(0.7));
        assert_eq!(s.reach(), Some(BY_TOTAL_HEAD));
        assert_eq!(s.picks(), [3, 4, 9, 700]);
    }
}
