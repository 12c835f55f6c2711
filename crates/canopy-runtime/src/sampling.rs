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
//! A draw that changes no logits (no penalty, no bias) reaches only a row's most likely tokens
//! when it is greedy or cut by `top_k` ([`Sampler::reach`]). Such rows are narrowed on the
//! backend ([`canopy_engine::LayerOps::top_logits`]) and the host reads `k` tokens a row
//! instead of the vocabulary; the tokens come in [`canopy_core::logits`]' order, which the draw
//! from a whole row follows too, so both draw the same token.
//!
//! A draw at a temperature over the whole vocabulary (no `top_k`) is narrowed too, with its
//! row's softmax total summed on the backend ([`canopy_engine::LayerOps::softmax_totals`]):
//! the draw walks the likeliest tokens in order, each's probability its term over that total,
//! and needs the whole row only when it lands past them ([`Sampler::sample`]). Past them it
//! walks the rest of the row by token id, a pass with no sort (in order only where `top_p`
//! must find its cut). The walk over a narrowed row is the start of the walk over the whole
//! one, so the token depends on the row, its total and the seed alone.
//!
//! A drawn token's log-probability ([`TokenLogprobs`]) comes from its whole row, or from the
//! row's log-normaliser and likeliest tokens reduced on the backend ([`RowTerms`]).

use canopy_core::logits::{likelier, most_likely, top_tokens};
use canopy_engine::TOP_LOGITS_MAX;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::{BTreeMap, HashMap, HashSet};

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
            Some(TOP_LOGITS_MAX)
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
    /// The row's most likely tokens, in [`canopy_core::logits`]' order, and their logits.
    Top {
        tokens: &'a [u32],
        logits: &'a [f32],
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
    },
}

/// What a row's log-probabilities need, reduced on the backend: its log-normaliser
/// ([`canopy_engine::LayerOps::logprob_terms`]) and its likeliest tokens with their logits.
#[derive(Debug, Clone, PartialEq)]
pub struct RowTerms {
    pub lse: f32,
    pub top: Vec<(u32, f32)>,
}

impl RowTerms {
    /// The log-probability of a token whose logit is `logit`, with the row's `n` likeliest.
    pub fn logprobs(&self, logit: f32, n: usize) -> TokenLogprobs {
        TokenLogprobs {
            logprob: logit - self.lse,
            top: (self.top.iter().take(n))
                .map(|&(t, x)| (t, x - self.lse))
                .collect(),
        }
    }
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
            StepLogits::Top { k, .. } => {
                let (logits, tokens) = row.split_at(*k);
                RowLogits::Top {
                    // The tokens are f32 bit patterns (`LayerOps::top_logits`).
                    tokens: bytemuck::cast_slice(tokens),
                    logits,
                }
            }
        }
    }

    /// Row `r`, owned: what a caller keeps past the step.
    pub fn row_owned(&self, r: usize) -> StepLogits {
        match self.row(r) {
            RowLogits::Whole(row) => StepLogits::Whole {
                vocab: row.len(),
                logits: row.to_vec(),
            },
            RowLogits::Top { logits, .. } => StepLogits::top(logits.len(), self.span(r).to_vec()),
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

/// The likeliest tokens of a row a draw by total walks in order before the rest: as many as a
/// backend narrows a row to.
const BY_TOTAL_HEAD: usize = TOP_LOGITS_MAX;

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
    /// The uniform number of a draw by total that landed past its narrowed row: the draw
    /// from the whole row goes on with it.
    pending: Option<f64>,
}

impl Sampler {
    /// A sample of `prompt` (which only `repetition_penalty` reads).
    pub fn new(params: SamplingParams, seed: u64, prompt: &[u32]) -> Sampler {
        Sampler {
            params,
            rng: ChaCha8Rng::seed_from_u64(seed),
            drawn: HashMap::new(),
            prompt: match params.repetition_penalty != 1.0 {
                true => prompt.iter().copied().collect(),
                false => HashSet::new(),
            },
            bias: Vec::new(),
            pending: None,
        }
    }

    /// The sampler with `bias` added to its tokens' logits before each draw.
    pub fn with_bias(mut self, bias: &[(u32, f32)]) -> Sampler {
        self.bias = bias.to_vec();
        self.bias.sort_unstable_by_key(|&(t, _)| t);
        self
    }

    /// How many of a row's most likely tokens this sampler's next draw may reach (`None`: the
    /// whole row).
    ///
    /// Penalties of these signs and biases below 0 only lower logits, and only those of the
    /// tokens the prompt holds or the sample drew, or the biased ones. Of a row's `k + m`
    /// most likely tokens, where `m` tokens are lowered, at least `k` keep their logits, and
    /// each is at least as likely as any token past them: so the `k` most likely after the
    /// penalties are among those `k + m`. A penalty of the other sign, or a bias above 0, can
    /// lift any token into the lead, and such a draw reads the whole row.
    pub fn reach(&self) -> Option<usize> {
        let k = self.params.reach()?;
        let p = self.params;
        if !p.penalizes() && self.bias.is_empty() {
            return Some(k);
        }
        // A total summed on the backend is the unchanged row's.
        if p.draws_by_total() {
            return None;
        }
        let lowers = p.frequency_penalty >= 0.0
            && p.presence_penalty >= 0.0
            && p.repetition_penalty >= 1.0
            && self.bias.iter().all(|&(_, b)| b <= 0.0);
        if !lowers {
            return None;
        }
        // Past what a backend narrows to, the prompt is not counted token by token each step.
        let lowered = self.drawn.len() + self.bias.len();
        if k + lowered + self.prompt.len().saturating_sub(lowered) > TOP_LOGITS_MAX {
            return None;
        }
        let prompt_only = (self.prompt.iter())
            .filter(|t| !self.drawn.contains_key(t))
            .count();
        Some(k + lowered + prompt_only)
    }

    /// The temperature at which this sampler's draws read their row's softmax total
    /// ([`canopy_engine::LayerOps::softmax_totals`]), if they do: draws over the whole
    /// vocabulary that change no logits.
    pub fn total_temperature(&self) -> Option<f32> {
        let p = self.params;
        (p.draws_by_total() && !p.penalizes() && self.bias.is_empty()).then_some(p.temperature)
    }

    /// The next token from one row of logits: whole, or narrowed to at least
    /// [`Sampler::reach`] tokens, with the row's softmax `total` at the sampler's
    /// temperature where it was read ([`Sampler::total_temperature`]).
    ///
    /// `None`: a draw by total landed past the narrowed row. The sampler keeps the draw, and
    /// the next call, with the same row whole and the same total, finishes it.
    pub fn sample(&mut self, row: RowLogits, total: Option<f32>) -> Option<u32> {
        match total {
            Some(total) if self.total_temperature().is_some() => self.sample_by_total(row, total),
            _ => Some(self.sample_adjusted(row)),
        }
    }

    /// A draw by total ([`Sampler::sample`]), from a row narrowed or whole.
    fn sample_by_total(&mut self, row: RowLogits, total: f32) -> Option<u32> {
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
            return std::iter::successors(Some(16 * BY_TOTAL_HEAD), |k| {
                (*k < whole.len()).then_some(k * 16)
            })
            .find_map(|k| {
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
        let in_head: HashSet<u32> = head.iter().copied().collect();
        let past = (0..whole.len() as u32)
            .filter(|t| !in_head.contains(t))
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

    /// The next token from one row of logits, the sample's penalties taken and its bias added.
    fn sample_adjusted(&mut self, row: RowLogits) -> u32 {
        if !self.params.penalizes() && self.bias.is_empty() {
            return self.sample_row(row);
        }
        let token = match row {
            RowLogits::Whole(logits) => {
                let adjusted = self.adjusted(logits);
                self.sample_row(RowLogits::Whole(&adjusted))
            }
            RowLogits::Top { tokens, logits } => {
                // The narrowed tokens adjusted, then put in order again.
                let mut adjusted: Vec<(u32, f32)> = (tokens.iter().zip(logits))
                    .map(|(&t, &x)| (t, self.adjust(t, x)))
                    .collect();
                adjusted.sort_unstable_by(|&(a, x), &(b, y)| likelier(a, x, b, y));
                let (tokens, logits): (Vec<u32>, Vec<f32>) = adjusted.into_iter().unzip();
                self.sample_row(RowLogits::Top {
                    tokens: &tokens,
                    logits: &logits,
                })
            }
        };
        if self.params.penalizes() {
            *self.drawn.entry(token).or_default() += 1;
        }
        token
    }

    /// Token `t`'s logit `x` with the sample's penalties taken and its bias added: the
    /// repetition penalty, then the frequency and presence penalties, in the order other
    /// OpenAI-compatible servers take them, then the bias.
    fn adjust(&self, t: u32, mut x: f32) -> f32 {
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
        if let Ok(i) = self.bias.binary_search_by_key(&t, |&(u, _)| u) {
            x += self.bias[i].1;
        }
        x
    }

    /// A whole row adjusted ([`Sampler::adjust`]) where a penalty or a bias reaches.
    fn adjusted(&self, logits: &[f32]) -> Vec<f32> {
        let mut row = logits.to_vec();
        let reached: HashSet<u32> = (self.prompt.iter().chain(self.drawn.keys()).copied())
            .chain(self.bias.iter().map(|&(t, _)| t))
            .collect();
        for t in reached {
            if let Some(x) = row.get_mut(t as usize) {
                *x = self.adjust(t, *x);
            }
        }
        row
    }

    /// The next token from one row of logits, without penalties.
    fn sample_row(&mut self, row: RowLogits) -> u32 {
        let p = self.params;
        match row {
            RowLogits::Whole(logits) => {
                if p.temperature <= 0.0 {
                    return most_likely(logits).unwrap_or(0);
                }
                let k = if p.top_k > 0 { p.top_k } else { logits.len() };
                let tokens = top_tokens(logits, k);
                let values: Vec<f32> = tokens.iter().map(|&t| logits[t as usize]).collect();
                self.draw(&tokens, &values)
            }
            RowLogits::Top { tokens, logits } => {
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

/// The most alternatives [`TokenLogprobs::of`] reports beside a token (OpenAI's limit for
/// `top_logprobs`).
pub const LOGPROBS_MAX: usize = 20;

/// A drawn token's log-probability under the model, and the most likely tokens' beside it.
///
/// The probabilities are the softmax of the row's logits as the model computed them, before
/// the draw's temperature or cuts, as other OpenAI-compatible servers report them: a token's
/// log-probability does not depend on how it was drawn.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct TokenLogprobs {
    pub logprob: f32,
    /// The most likely tokens and their log-probabilities, most likely first.
    pub top: Vec<(u32, f32)>,
}

impl TokenLogprobs {
    /// `token`'s log-probability in `logits`, a whole row, with the row's `top` most likely
    /// tokens (at most [`LOGPROBS_MAX`]).
    pub fn of(logits: &[f32], token: u32, top: usize) -> TokenLogprobs {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        // Each term to f32's precision, their sum to f64's.
        let sum: f64 = logits.iter().map(|&x| f64::from((x - max).exp())).sum();
        let log_total = max as f64 + sum.ln();
        let logprob = |t: u32| (logits[t as usize] as f64 - log_total) as f32;
        TokenLogprobs {
            logprob: logprob(token),
            top: top_tokens(logits, top.min(LOGPROBS_MAX))
                .into_iter()
                .map(|t| (t, logprob(t)))
                .collect(),
        }
    }
}

/// The two most likely tokens of one step's logits.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct TopTwo {
    pub token: u32,
    pub logit: f32,
    pub second_token: u32,
    pub second_logit: f32,
}

impl TopTwo {
    /// The two most likely tokens of `row` (whole, or narrowed to at least two).
    pub fn of(row: RowLogits) -> TopTwo {
        let (tokens, logits): (Vec<u32>, Vec<f32>) = match row {
            RowLogits::Whole(logits) => top_tokens(logits, 2)
                .into_iter()
                .map(|t| (t, logits[t as usize]))
                .unzip(),
            RowLogits::Top { tokens, logits } => (tokens.to_vec(), logits.to_vec()),
        };
        let at = |i: usize| {
            (
                tokens.get(i).copied().unwrap_or(0),
                logits.get(i).copied().unwrap_or(f32::NEG_INFINITY),
            )
        };
        let ((token, logit), (second_token, second_logit)) = (at(0), at(1));
        TopTwo {
            token,
            logit,
            second_token,
            second_logit,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `logits` narrowed to their `k` most likely tokens, as a backend's `top_logits` leaves
    /// them.
    fn narrowed(logits: &[f32], k: usize) -> StepLogits {
        let tokens = top_tokens(logits, k);
        let mut rows: Vec<f32> = tokens.iter().map(|&t| logits[t as usize]).collect();
        rows.extend(tokens.iter().map(|&t| f32::from_bits(t)));
        StepLogits::top(k, rows)
    }

    #[test]
    fn logprobs_are_the_log_softmax_and_the_top_come_in_order() {
        let logits = [1.0f32, 4.0, -2.0, 4.0, 0.5, 300.0];
        let total: f64 = logits.iter().map(|&x| (x as f64 - 300.0).exp()).sum();
        let lp = TokenLogprobs::of(&logits, 3, 3);
        let expect = |t: usize| ((logits[t] as f64 - 300.0) - total.ln()) as f32;
        assert_eq!(lp.logprob, expect(3));
        let tokens: Vec<u32> = lp.top.iter().map(|&(t, _)| t).collect();
        assert_eq!(tokens, [5, 1, 3]);
        for &(t, x) in &lp.top {
            assert!((x - expect(t as usize)).abs() <= 1e-6, "{t}: {x}");
        }
        // The most likely token of a row this peaked holds almost all of its probability.
        assert!(lp.top[0].1.abs() < 1e-6 && lp.top[1].1 < -290.0);
        assert!(TokenLogprobs::of(&logits, 0, 0).top.is_empty());
        assert_eq!(
            TokenLogprobs::of(&[0.0; 64], 7, 100).top.len(),
            LOGPROBS_MAX
        );
    }

    #[test]
    fn top_two_names_the_two_largest() {
        let logits = [0.5, 3.0, -1.0, 2.5, 3.0];
        let t = TopTwo::of(RowLogits::Whole(&logits));
        assert_eq!((t.token, t.logit), (1, 3.0));
        assert_eq!((t.second_token, t.second_logit), (4, 3.0));
        assert_eq!(TopTwo::of(narrowed(&logits, 2).row(0)), t);
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
        for (temperature, top_k, top_p) in [(0.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 40, 0.8)] {
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
            Some(TOP_LOGITS_MAX),
            "a draw over the whole vocabulary reads as many as a backend narrows to"
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
        // A bias lifts a token into the lead, or takes one out of it.
        let mut s =
            Sampler::new(SamplingParams::default(), 0, &[]).with_bias(&[(2, 3.5), (0, -100.0)]);
        assert_eq!(s.reach(), None);
        assert_eq!(s.sample(RowLogits::Whole(&logits), None).unwrap(), 2);
        let mut s = Sampler::new(SamplingParams::default(), 0, &[]).with_bias(&[(0, -1.0)]);
        assert_eq!(s.reach(), Some(2), "its likeliest and the one it lowers");
        assert_eq!(s.sample(RowLogits::Whole(&logits), None).unwrap(), 1);
        // A penalty that lifts reads the whole row; one that lowers reaches one token further
        // for each token it may lower.
        let lifts = SamplingParams {
            presence_penalty: -0.5,
            ..SamplingParams::default()
        };
        assert_eq!(Sampler::new(lifts, 0, &[]).reach(), None);
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

    proptest::proptest! {
        /// A draw that only lowers logits, from a row narrowed to its sampler's reach, is the
        /// draw from the whole row, step after step, on rows with many ties.
        #[test]
        fn a_lowering_draw_from_its_reach_is_the_whole_rows(
            seed in 0u64..1000,
            greedy in proptest::bool::ANY,
            top_k in 1usize..6,
            frequency in 0.0f32..1.5,
            presence in 0.0f32..1.5,
            repetition in 1.0f32..2.0,
            prompt in proptest::collection::vec(0u32..60, 0..12),
            bias in proptest::collection::vec((0u32..60, -5.0f32..0.0), 0..3),
        ) {
            let params = SamplingParams {
                temperature: if greedy { 0.0 } else { 0.9 },
                top_k,
                top_p: 0.9,
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
                let logits: Vec<f32> = (0..60u64)
                    .map(|i| ((i * 7 + step * 13 + seed) % 9) as f32 * 0.5)
                    .collect();
                let k = narrow.reach().expect("it lowers only");
                let a = whole.sample(RowLogits::Whole(&logits), None).unwrap();
                let b = narrow.sample(narrowed(&logits, k.min(60)).row(0), None).unwrap();
                proptest::prop_assert_eq!(a, b, "step {}, reach {}", step, k);
            }
        }
    }

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
