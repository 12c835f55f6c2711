//! Rank 0's draws: each row's token from its logits, with its log-probabilities where its
//! request asks for them, then the token told to its client.

use super::Scheduler;
use crate::sampling::{RowLogits, RowTerms, Sampler, TokenLogprobs};
use crate::serving::handle::{Event, FinishReason};
use rayon::prelude::*;
use std::collections::HashMap;

/// One row to draw: sample `sample` of request `id`, from its `logits`, with its row's
/// reduced `terms` where they were read.
pub(super) struct DrawRow<'a> {
    pub id: u64,
    pub sample: usize,
    pub logits: RowLogits<'a>,
    pub terms: Option<&'a RowTerms>,
}

/// A drawn token and its log-probabilities.
pub(super) type Drawn = (u32, Option<TokenLogprobs>);

impl Scheduler<'_> {
    /// Each row's token with its log-probabilities where its request asks for them (`None`:
    /// the request has ended): from a whole row, or from the row's reduced terms and the
    /// drawn token's logit in its narrowed row. Rows are drawn in parallel where some are
    /// whole, a pass over the vocabulary each.
    pub(super) fn draw_rows(&mut self, rows: &[DrawRow]) -> Vec<Option<Drawn>> {
        let mut samplers: HashMap<(u64, usize), (&mut Sampler, Option<usize>)> = HashMap::new();
        for (&id, r) in self.running.iter_mut() {
            let logprobs = r.submitted.request.logprobs;
            for (i, s) in r.samples.iter_mut().enumerate() {
                samplers.insert((id, i), (&mut s.sampler, logprobs));
            }
        }
        let mut work: Vec<_> = rows
            .iter()
            .map(|row| (samplers.remove(&(row.id, row.sample)), row))
            .collect();
        let draw = |(sampler, row): &mut (Option<(&mut Sampler, Option<usize>)>, &DrawRow)| {
            let (sampler, logprobs) = sampler.as_mut()?;
            let token = sampler.sample(row.logits);
            let logprobs = match (*logprobs, row.logits, row.terms) {
                (Some(n), RowLogits::Whole(logits), _) => Some(TokenLogprobs::of(logits, token, n)),
                (Some(n), RowLogits::Top { tokens, logits }, Some(terms)) => (tokens.iter())
                    .position(|&t| t == token)
                    .map(|i| terms.logprobs(logits[i], n)),
                // Not met: a row that reports log-probabilities is read whole or reduced.
                (Some(_), RowLogits::Top { .. }, None) | (None, ..) => None,
            };
            Some((token, logprobs))
        };
        let whole = |(_, row): &(_, &DrawRow)| matches!(row.logits, RowLogits::Whole(_));
        match work.iter().filter(|w| whole(w)).count() > 1 {
            true => work.par_iter_mut().map(draw).collect(),
            false => work.iter_mut().map(draw).collect(),
        }
    }

    /// Takes sample `sample` of request `id`'s drawn `token` and tells its client.
    pub(super) fn tell(
        &mut self,
        id: u64,
        sample: usize,
        token: u32,
        logprobs: Option<TokenLogprobs>,
    ) {
        let Some(r) = self.running.get_mut(&id) else {
            return;
        };
        let request = &r.submitted.request;
        let (max_tokens, stops) = (request.max_tokens, request.stop.clone());
        let eos_ends = !request.ignore_eos;
        let s = &mut r.samples[sample];
        s.drawn += 1;
        self.status.generated_tokens += 1;
        // A token the tokenizer cannot decode adds no text; the ids are still the output.
        let piece = s.decoder.push(token).unwrap_or_default();
        let (text, stop_string) = s.text.push(&piece, &stops);
        let reason = if stop_string || (eos_ends && self.stop_tokens.contains(&token)) {
            Some(FinishReason::Stop)
        } else {
            (s.drawn >= max_tokens).then_some(FinishReason::Length)
        };
        let mut alive = r.send(Event::Token {
            sample,
            token,
            text,
            logprobs,
        });
        let s = &mut r.samples[sample];
        match reason {
            None => s.next = Some(token),
            Some(reason) => {
                let text = s.text.finish();
                s.next = None;
                s.done = true;
                alive &= r.send(Event::Finished {
                    sample,
                    reason,
                    text,
                });
                if r.samples.iter().all(|s| s.done) {
                    self.running.remove(&id);
                    self.ending.push(id);
                    return;
                }
                if r.samples[sample].drawn > 1 {
                    self.ended_samples.push((id, sample as u32));
                }
            }
        }
        if !alive {
            self.cancel(id);
        }
    }
}
