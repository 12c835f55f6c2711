//! Choosing the next token from logits: greedy at temperature 0, otherwise softmax at the
//! temperature, cut to the `top_k` most likely and to the smallest set whose probability
//! reaches `top_p`, drawn from a seeded generator. Every rank holds the same logits and the
//! same generator, so every rank draws the same token.
//!
//! Before the draw, penalties may lower the logits of tokens a sample repeats: OpenAI's
//! `frequency_penalty` and `presence_penalty` over the tokens the sample drew, and
//! transformers' `repetition_penalty` over those and the prompt's; and fixed biases
//! (OpenAI's `logit_bias`) may be added to chosen tokens' logits.
//!
//! A draw reaches only a row's most likely tokens when it is greedy or cut by `top_k`
//! ([`Sampler::reach`]). Such rows are narrowed on the
//! backend ([`canopy_engine::LayerOps::top_logits`]) and the host reads `k` tokens a row
//! instead of the vocabulary; the tokens come in [`canopy_core::logits`]' order, which the draw
//! from a whole row follows too, so both draw the same token.
//!
//! A draw at a temperature over the whole vocabulary (no `top_k`) is narrowed too, with its
//! row's softmax total summed on the backend ([`canopy_engine::LayerOps::softmax_totals`]):
//! the draw walks the likeliest tokens in order, each's probability its term over that total
//! ([`Sampler::sample`]). Past them it walks the rest of the row by token id, a pass with no
//! sort, which the backend takes where the row lies ([`Sampler::tail_walk`],
//! [`canopy_engine::LayerOps::walk_tails`]). A `top_p` cut past them keeps the fewest
//! likeliest of the rest that reach it, found by selection there too; a draw that lands on one
//! of them wherever that cut falls needs no more of the row. The walk over a narrowed row is the start of the walk over the whole one, so the
//! token depends on the row, its total and the seed alone. A whole row drawn so without a
//! backend's total (a prompt's last) has it summed on the host.
//!
//! A draw that changes logits (penalties, biases) reads its row narrowed too, with the logits
//! of the tokens it changes picked on the backend beside it
//! ([`canopy_engine::LayerOps::pick_logits`], [`Sampler::picks`]): the changed row's likeliest
//! tokens are among the narrowed and the picked ones, and a draw over the whole vocabulary
//! takes the changed row's total from the backend's (`adjusted`).
//!
//! A drawn token's log-probability ([`TokenLogprobs`]) comes from its whole row, or from the
//! row's log-normaliser and likeliest tokens reduced on the backend ([`RowTerms`]).

use canopy_core::logits::{most_likely, softmax_total, top_tokens};
use canopy_engine::TOP_LOGITS_MAX;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::{BTreeMap, HashMap, HashSet};

mod adjusted;
mod by_total;
mod logprobs;

pub use adjusted::PICKS_MAX;
pub use logprobs::{token_logprobs, RowTerms, TokenLogprobs, TopTwo, LOGPROBS_MAX};

/// How tokens are drawn.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// 0: greedy (the most likely token, the lower of equals).
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens (0: all).
    pub top_k: usize,
    /// Keep the most likely tokens until their probability reaches `top_p` (1: all).
    pub top_p: f32,
    /// Taken from a token's logit once for each time the sample drew it (0: none).
    pub frequency_penalty: f32,
    /// Taken from a token's logit once the sample has drawn it (0: none).
    pub presence_penalty: f32,
    /// Divides the positive logit, and multiplies the negative one, of a token the prompt
    /// holds or the sample drew (1: none).
    pub repetition_penalty: f32,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            repetition_penalty: 1.0,
        }
    }
}

impl SamplingParams {
    /// Whether a draw changes logits by the tokens seen before it.
    pub fn penalizes(&self) -> bool {
        self.frequency_penalty != 0.0
            || self.presence_penalty != 0.0
            || self.repetition_penalty != 1.0
    }

    /// Whether a draw is over the whole vocabulary at a temperature (no `top_k`): one that
    /// reads its row's softmax total ([`Sampler::total_temperature`]).
    fn draws_by_total(&self) -> bool {
        self.temperature > 0.0 && self.top_k == 0
    }

    /// How many of a row's most likely tokens a draw that changes no logits may reach, if the
    /// backend can narrow a row to that many (`None`: the draw reads the whole row). A draw
    /// over the whole vocabulary reads as many as a backend narrows to, beside its row's
    /// total, and its whole row where it lands past them.
    pub fn reach(&self) -> Option<usize> {
        if self.temperature <= 0.0 {
            Some(1)
        } else if self.draws_by_total() {
            Some(by_total::BY_TOTAL_HEAD)
        } else {
            Some(self.top_k).filter(|&k| k <= TOP_LOGITS_MAX)
        }
    }
}

/// The tokens a step's rows are narrowed to: enough for every row's reach (`None`: a row
/// needs its whole logits, and so the step does), rounded up to a power of two, so that a
/// reach that grows step by step (a penalised sample's) changes the step's shape, and a
/// recorded graph, a few times only. `at_least` raises the count (a caller that reports the
/// top two).
pub fn step_reach(rows: impl IntoIterator<Item = Option<usize>>, at_least: usize) -> Option<usize> {
    rows.into_iter()
        .try_fold(at_least.max(1), |k, reach| reach.map(|r| k.max(r)))
        .map(usize::next_power_of_two)
        .filter(|&k| k <= TOP_LOGITS_MAX)
}

/// One row of a step's logits, as the host holds it.
#[derive(Debug, Clone, Copy)]
pub enum RowLogits<'a> {
    /// Every token's logit.
    Whole(&'a [f32]),
    /// The row's most likely tokens, in [`canopy_core::logits`]' order, and their logits,
    /// with the logits of the tokens picked beside them ([`Sampler::picks`]).
    Top {
        tokens: &'a [u32],
        logits: &'a [f32],
        picked: &'a [(u32, f32)],
    },
}

/// A step's logits on the host: each row whole, or narrowed on the backend to its `k` most
/// likely tokens, with some rows also read whole.
#[derive(Debug, Clone, PartialEq)]
pub enum StepLogits {
    Whole {
        vocab: usize,
        logits: Vec<f32>,
    },
    Top {
        k: usize,
        rows: Vec<f32>,
        /// Rows read whole as well, by row: those whose draw needs more than `k` tokens.
        whole: BTreeMap<usize, Vec<f32>>,
        /// Rows' log-normalisers and likeliest tokens, by row: those that report their drawn
        /// token's log-probability.
        terms: BTreeMap<usize, RowTerms>,
        /// Rows' softmax totals at their temperatures, by row: those whose draw is over the
        /// whole vocabulary ([`Sampler::total_temperature`]).
        totals: BTreeMap<usize, f32>,
        /// Tokens' logits picked beside their narrowed rows, by row: those the rows' draws
        /// change ([`Sampler::picks`]).
        picked: BTreeMap<usize, Vec<(u32, f32)>>,
    },
}

impl StepLogits {
    /// Rows narrowed to `k` tokens each (`rows`: each row's `k` logits, then its `k` tokens
    /// as bit patterns), none read whole.
    pub fn top(k: usize, rows: Vec<f32>) -> StepLogits {
        StepLogits::Top {
            k,
            rows,
            whole: BTreeMap::new(),
            terms: BTreeMap::new(),
            totals: BTreeMap::new(),
            picked: BTreeMap::new(),
        }
    }

    /// Row `r`'s softmax total at its sampler's temperature, where it was read.
    pub fn total(&self, r: usize) -> Option<f32> {
        match self {
            StepLogits::Top { totals, .. } => totals.get(&r).copied(),
            StepLogits::Whole { .. } => None,
        }
    }

    /// Row `r`'s log-normaliser and likeliest tokens, where they were read.
    pub fn terms(&self, r: usize) -> Option<&RowTerms> {
        match self {
            StepLogits::Top { terms, .. } => terms.get(&r),
            StepLogits::Whole { .. } => None,
        }
    }

    /// Row `r`: whole where it was read whole.
    pub fn row(&self, r: usize) -> RowLogits<'_> {
        if let StepLogits::Top { whole, .. } = self {
            if let Some(row) = whole.get(&r) {
                return RowLogits::Whole(row);
            }
        }
        let row = self.span(r);
        match self {
            StepLogits::Whole { .. } => RowLogits::Whole(row),
            StepLogits::Top { k, picked, .. } => {
                let (logits, tokens) = row.split_at(*k);
                RowLogits::Top {
                    // The tokens are f32 bit patterns (`LayerOps::top_logits`).
                    tokens: bytemuck::cast_slice(tokens),
                    logits,
                    picked: picked.get(&r).map_or(&[], Vec::as_slice),
                }
            }
        }
    }

    /// Row `r`, owned, as row 0 with its terms, total and picked logits where they were read:
    /// what a caller keeps past the step.
    pub fn row_owned(&self, r: usize) -> StepLogits {
        match self.row(r) {
            RowLogits::Whole(row) => StepLogits::Whole {
                vocab: row.len(),
                logits: row.to_vec(),
            },
            RowLogits::Top { logits, picked, .. } => StepLogits::Top {
                k: logits.len(),
                rows: self.span(r).to_vec(),
                whole: BTreeMap::new(),
                terms: self.terms(r).map(|t| (0, t.clone())).into_iter().collect(),
                totals: self.total(r).map(|t| (0, t)).into_iter().collect(),
                picked: match picked.is_empty() {
                    true => BTreeMap::new(),
                    false => BTreeMap::from([(0, picked.to_vec())]),
                },
            },
        }
    }

    /// Row `r`'s numbers as held: `vocab` logits, or `k` logits then `k` token ids.
    fn span(&self, r: usize) -> &[f32] {
        let (width, data) = match self {
            StepLogits::Whole { vocab, logits } => (*vocab, logits),
            StepLogits::Top { k, rows, .. } => (2 * k, rows),
        };
        &data[r * width..(r + 1) * width]
    }
}

/// One sample's generator: sample `i` of a run seeded with `seed` draws from `seed + i`, so
/// it equals the same seed's sample decoded alone.
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
    /// How often the sample drew each token, kept while a penalty reads it.
    drawn: HashMap<u32, u32>,
    /// The prompt's tokens, kept while `repetition_penalty` reads them.
    prompt: HashSet<u32>,
    /// Added to these tokens' logits before each draw.
    bias: Vec<(u32, f32)>,
    /// The tokens whose logits the draws may change, in order: the prompt's (under
    /// `repetition_penalty`), the biased, and those drawn (under a penalty).
    changed: Vec<u32>,
    /// A draw by total that landed past its narrowed row: the draw from the whole row, or
    /// over the rest of the row on the backend, goes on with it.
    pending: Option<by_total::Pending>,
}

impl Sampler {
    /// A sample of `prompt` (which only `repetition_penalty` reads).
    pub fn new(params: SamplingParams, seed: u64, prompt: &[u32]) -> Sampler {
        let prompt: HashSet<u32> = match params.repetition_penalty != 1.0 {
            true => prompt.iter().copied().collect(),
            false => HashSet::new(),
        };
        let mut changed: Vec<u32> = prompt.iter().copied().collect();
        changed.sort_unstable();
        Sampler {
            params,
            rng: ChaCha8Rng::seed_from_u64(seed),
            drawn: HashMap::new(),
            prompt,
            bias: Vec::new(),
            changed,
            pending: None,
        }
    }

    /// The sampler with `bias` added to its tokens' logits before each draw.
    pub fn with_bias(mut self, bias: &[(u32, f32)]) -> Sampler {
        self.bias = bias.to_vec();
        self.bias.sort_unstable_by_key(|&(t, _)| t);
        self.changed.extend(self.bias.iter().map(|&(t, _)| t));
        self.changed.sort_unstable();
        self.changed.dedup();
        self
    }

    /// How many of a row's most likely tokens this sampler's next draw may reach (`None`: the
    /// whole row). A draw that changes logits reads as many more as the tokens it changes,
    /// up to what a backend narrows to, beside their logits ([`Sampler::picks`]); it reads its
    /// whole row where it changes more than [`PICKS_MAX`] tokens, or where the narrowed and
    /// the picked tokens cannot settle it ([`Sampler::sample`]).
    pub fn reach(&self) -> Option<usize> {
        let k = self.params.reach()?;
        match self.adjusts() {
            false => Some(k),
            true => self.adjusted_reach(k),
        }
    }

    /// The temperature at which this sampler's draws read their row's softmax total
    /// ([`canopy_engine::LayerOps::softmax_totals`]), if they do: draws over the whole
    /// vocabulary.
    pub fn total_temperature(&self) -> Option<f32> {
        let p = self.params;
        p.draws_by_total().then_some(p.temperature)
    }

    /// The next token from one row of logits: whole, or narrowed to at least
    /// [`Sampler::reach`] tokens with the logits of [`Sampler::picks`] beside them, with the
    /// row's softmax `total` at the sampler's temperature where it was read
    /// ([`Sampler::total_temperature`]). The sample's penalties are taken and its bias added.
    ///
    /// `None`: the narrowed row does not settle the draw (a draw by total landed past it, or
    /// the draw changes too many of its tokens). The sampler keeps the draw, and the next
    /// call, with the same row whole and the same total, finishes it. A whole row drawn over
    /// the whole vocabulary without its total (a prompt's last) has it summed on the host
    /// ([`canopy_core::logits::softmax_total`]).
    pub fn sample(&mut self, row: RowLogits, total: Option<f32>) -> Option<u32> {
        let token = match total {
            _ if self.adjusts() => self.sample_adjusted(row, total)?,
            Some(total) if self.params.draws_by_total() => self.sample_by_total(row, total)?,
            _ => self.sample_row(row),
        };
        self.record(token);
        Some(token)
    }

    /// Counts a drawn `token` where a penalty reads what the sample drew.
    fn record(&mut self, token: u32) {
        if self.params.penalizes() {
            *self.drawn.entry(token).or_default() += 1;
            if let Err(at) = self.changed.binary_search(&token) {
                self.changed.insert(at, token);
            }
        }
    }

    /// The next token from one row of logits, unchanged.
    fn sample_row(&mut self, row: RowLogits) -> u32 {
        let p = self.params;
        match row {
            RowLogits::Whole(logits) => {
                if p.temperature <= 0.0 {
                    return most_likely(logits).unwrap_or(0);
                }
                if p.draws_by_total() {
                    let total = softmax_total(logits, p.temperature);
                    return self.sample_by_total(row, total).unwrap_or(0);
                }
                let tokens = top_tokens(logits, p.top_k);
                let values: Vec<f32> = tokens.iter().map(|&t| logits[t as usize]).collect();
                self.draw(&tokens, &values)
            }
            RowLogits::Top { tokens, logits, .. } => {
                // At least the reach, or the whole vocabulary in order; a draw over the whole
                // vocabulary reads its row's total beside these.
                debug_assert!(!p.draws_by_total(), "a narrowed row without its total");
                if p.temperature <= 0.0 {
                    return tokens[0];
                }
                let keep = match p.top_k {
                    0 => tokens.len(),
                    k => k.min(tokens.len()),
                };
                self.draw(&tokens[..keep], &logits[..keep])
            }
        }
    }

    /// A token drawn from `tokens` (most likely first, with their `logits`): softmax at the
    /// temperature, cut at `top_p`.
    fn draw(&mut self, tokens: &[u32], logits: &[f32]) -> u32 {
        let p = self.params;
        let max = logits[0];
        let mut probs: Vec<f64> = logits
            .iter()
            .map(|&x| (((x - max) / p.temperature) as f64).exp())
            .collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|x| *x /= total);
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            let keep = probs
                .iter()
                .position(|&x| {
                    acc += x;
                    acc >= p.top_p as f64
                })
                .map_or(probs.len(), |i| i + 1);
            probs.truncate(keep);
        }
        let total: f64 = probs.iter().sum();
        let mut draw = self.rng.gen::<f64>() * total;
        for (&t, &x) in tokens.iter().zip(&probs) {
            if draw < x {
                return t;
            }
            draw -= x;
        }
        tokens[probs.len() - 1]
    }
}

/// The frequency and presence penalties OpenAI's API takes.
pub const PENALTY_RANGE: std::ops::RangeInclusive<f32> = -2.0..=2.0;

#[cfg(test)]
mod tests {
    use super::*;

    /// `logits` narrowed to their `k` most likely tokens, as a backend's `top_logits` leaves
    /// them.
    pub(super) fn narrowed(logits: &[f32], k: usize) -> StepLogits {
        let tokens = top_tokens(logits, k);
        let mut rows: Vec<f32> = tokens.iter().map(|&t| logits[t as usize]).collect();
        rows.extend(tokens.iter().map(|&t| f32::from_bits(t)));
        StepLogits::top(k, rows)
    }

    /// `s`'s pending draw finished over the rest of `logits` on the CPU's `walk_tails`, as a
    /// step finishes it where the sampler offers its walk (`None`: it offers none).
    pub(super) fn walk_on_cpu(s: &mut Sampler, logits: &[f32]) -> Option<u32> {
        use canopy_engine::{CpuBackend, LayerOps};
        let walk = s.tail_walk()?.clone();
        let row = CpuBackend.upload_tensor(logits, 1, logits.len()).unwrap();
        let mut out = CpuBackend.tensor(1, 2).unwrap();
        (CpuBackend.walk_tails(&row, &[(0, &walk)], &mut out)).unwrap();
        s.land_tail(Some(out.data[0].to_bits()).filter(|&t| t != u32::MAX))
    }

    /// A row of `vocab` logits spread over `spread` with few distinct values, drawn from
    /// `seed`.
    pub(super) fn spread_row(seed: u64, vocab: usize, spread: f32) -> Vec<f32> {
        (0..vocab as u64)
            .map(|i| ((i * 7919 + seed * 31) % 997) as f32 / 997.0 * spread)
            .collect()
    }

    #[test]
    fn temperature_zero_is_the_likeliest_lower_of_equals() {
        let logits = [0.1, 3.0, 2.0, 3.0];
        let mut s = Sampler::new(SamplingParams::default(), 1, &[]);
        assert_eq!(s.sample(RowLogits::Whole(&logits), None).unwrap(), 1);
        assert_eq!(s.sample(narrowed(&logits, 1).row(0), None).unwrap(), 1);
    }

    #[test]
    fn top_k_one_is_greedy_and_seeds_repeat() {
        let logits: Vec<f32> = (0..50).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
        let greedy = most_likely(&logits).unwrap();
        let params = SamplingParams {
            temperature: 0.8,
            top_k: 1,
            top_p: 1.0,
            ..SamplingParams::default()
        };
        let whole = RowLogits::Whole(&logits);
        assert_eq!(
            Sampler::new(params, 3, &[]).sample(whole, None).unwrap(),
            greedy
        );
        let params = SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.9,
            ..SamplingParams::default()
        };
        let draw = |seed| {
            let mut s = Sampler::new(params, seed, &[]);
            (0..20)
                .map(|_| s.sample(whole, None).unwrap())
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(5), draw(5));
        assert_ne!(draw(5), draw(6));
    }

    /// A draw from a row narrowed to at least its reach is the draw from the whole row: the
    /// same tokens from the same seeds, for every temperature, `top_k` and `top_p`.
    #[test]
    fn a_narrowed_row_draws_what_the_whole_row_draws() {
        let logits: Vec<f32> = (0..3000)
            .map(|i| ((i * 7919 % 1000) as f32 * 0.013).sin() * 4.0)
            .collect();
        for (temperature, top_k, top_p) in [
            (0.0, 0, 1.0),
            (0.7, 5, 1.0),
            (1.3, 40, 0.8),
            (0.9, 600, 0.95),
        ] {
            let params = SamplingParams {
                temperature,
                top_k,
                top_p,
                ..SamplingParams::default()
            };
            let k = params.reach().unwrap();
            for extra in [0, 7] {
                let top = narrowed(&logits, k + extra);
                let (mut a, mut b) = (Sampler::new(params, 11, &[]), Sampler::new(params, 11, &[]));
                for _ in 0..50 {
                    assert_eq!(
                        a.sample(RowLogits::Whole(&logits), None).unwrap(),
                        b.sample(top.row(0), None).unwrap(),
                        "{params:?}, narrowed to {}",
                        k + extra
                    );
                }
            }
        }
    }

    #[test]
    fn a_step_reaches_as_far_as_its_widest_row() {
        let greedy = SamplingParams::default();
        let top = |top_k| SamplingParams {
            temperature: 1.0,
            top_k,
            top_p: 1.0,
            ..SamplingParams::default()
        };
        assert_eq!(
            step_reach([greedy, greedy].map(|p: SamplingParams| p.reach()), 1),
            Some(1)
        );
        assert_eq!(
            step_reach([greedy].map(|p: SamplingParams| p.reach()), 2),
            Some(2)
        );
        assert_eq!(
            step_reach([greedy, top(40)].map(|p: SamplingParams| p.reach()), 1),
            Some(64),
            "a power of two"
        );
        assert_eq!(
            step_reach([greedy, top(0)].map(|p: SamplingParams| p.reach()), 1),
            Some(by_total::BY_TOTAL_HEAD),
            "a draw over the whole vocabulary reads the head it walks"
        );
        assert_eq!(
            step_reach([top(0), top(200)].map(|p: SamplingParams| p.reach()), 1),
            Some(256),
            "a top_k past the head"
        );
        assert_eq!(
            step_reach(
                [top(TOP_LOGITS_MAX + 1)].map(|p: SamplingParams| p.reach()),
                1
            ),
            None
        );
        assert_eq!(step_reach([None; 0], 2), Some(2));
    }

    #[test]
    fn penalties_and_biases_move_the_draw() {
        let greedy = |penalties: (f32, f32, f32), prompt: &[u32], logits: &[f32], steps| {
            let (frequency_penalty, presence_penalty, repetition_penalty) = penalties;
            let params = SamplingParams {
                frequency_penalty,
                presence_penalty,
                repetition_penalty,
                ..SamplingParams::default()
            };
            let mut s = Sampler::new(params, 0, prompt);
            (0..steps)
                .map(|_| s.sample(RowLogits::Whole(logits), None).unwrap())
                .collect::<Vec<u32>>()
        };
        let logits = [3.0, 2.5, 0.0];
        // The frequency penalty grows with each draw, the presence penalty does not.
        assert_eq!(greedy((0.4, 0.0, 1.0), &[], &logits, 5), [0, 0, 1, 0, 1]);
        assert_eq!(greedy((0.0, 1.0, 1.0), &[], &logits, 5), [0, 1, 0, 0, 0]);
        assert_eq!(greedy((0.01, 0.0, 1.0), &[], &logits, 3), [0, 0, 0]);
        // The repetition penalty divides a positive logit and multiplies a negative one, of a
        // token in the prompt as of one drawn, once however often it came.
        assert_eq!(greedy((0.0, 0.0, 1.25), &[0, 0, 0], &logits, 3), [1, 0, 0]);
        assert_eq!(greedy((0.0, 0.0, 1.25), &[], &logits, 3), [0, 1, 0]);
        assert_eq!(greedy((0.0, 0.0, 1.25), &[0], &[-1.0, -1.1], 1), [1]);
        // A bias lifts a token into the lead, or takes one out of it. A draw reaches one
        // token further for each token it changes, and picks those it may lift.
        let mut s =
            Sampler::new(SamplingParams::default(), 0, &[]).with_bias(&[(2, 3.5), (0, -100.0)]);
        assert_eq!((s.reach(), s.picks()), (Some(3), vec![2]));
        assert_eq!(s.sample(RowLogits::Whole(&logits), None).unwrap(), 2);
        let mut s = Sampler::new(SamplingParams::default(), 0, &[]).with_bias(&[(0, -1.0)]);
        assert_eq!(s.reach(), Some(2), "its likeliest and the one it lowers");
        assert_eq!(s.picks(), Vec::<u32>::new());
        assert_eq!(s.sample(RowLogits::Whole(&logits), None).unwrap(), 1);
        let lifts = SamplingParams {
            presence_penalty: -0.5,
            ..SamplingParams::default()
        };
        let mut s = Sampler::new(lifts, 0, &[]);
        s.sample(RowLogits::Whole(&logits), None).unwrap();
        assert_eq!((s.reach(), s.picks()), (Some(2), vec![0]));
        let lowers = SamplingParams {
            repetition_penalty: 1.2,
            ..SamplingParams::default()
        };
        let mut s = Sampler::new(lowers, 0, &[4, 4, 5]);
        assert_eq!(s.reach(), Some(3));
        s.sample(RowLogits::Whole(&logits), None).unwrap();
        assert_eq!(
            s.reach(),
            Some(4),
            "the prompt's two tokens and the one drawn"
        );
    }

    #[test]
    fn top_p_keeps_only_the_likely_head() {
        let mut logits = vec![-10.0f32; 10];
        logits[4] = 5.0;
        let params = SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.5,
            ..SamplingParams::default()
        };
        let mut s = Sampler::new(params, 9, &[]);
        assert!((0..50).all(|_| s.sample(RowLogits::Whole(&logits), None).unwrap() == 4));
    }
}
