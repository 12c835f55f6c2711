//! Rank 0's draws: each row's token from its logits, with its log-probabilities where its
//! request asks for them.

use super::Scheduler;
use crate::forward::{Landed, WholeRows};
use crate::rank::ms;
use crate::sampling::{token_logprobs, RowLogits, RowTerms, Sampler, TokenLogprobs};
use crate::serving::handle::Event;
use crate::Result;
use canopy_core::logits::TailWalk;
use rayon::prelude::*;
use std::collections::HashMap;
use std::time::Instant;

/// One row to draw: sample `sample` of request `id`, from its `logits`, with its row's
/// reduced `terms` and its softmax `total` where they were read.
pub(super) struct DrawRow<'a> {
    pub id: u64,
    pub sample: usize,
    pub logits: RowLogits<'a>,
    pub terms: Option<&'a RowTerms>,
    pub total: Option<f32>,
    /// The row's place among the step's decode rows (`None`: a prompt's first token, drawn
    /// from its whole row).
    pub place: Option<usize>,
}

/// Where a step's decode rows lie on the backend, for draws that land past their narrowed
/// rows: each row read whole by its place, or the rest of a draw walked over it there.
#[derive(Clone, Copy)]
pub(crate) struct PastReads<'a> {
    pub read_whole: &'a dyn Fn(&[usize]) -> Result<WholeRows>,
    /// [`crate::forward::walk_tails`] over the rows, by their places.
    pub walk_tails: &'a WalkTails<'a>,
}

/// Walks of the rest of draws over rows, by their places.
pub(crate) type WalkTails<'a> = dyn Fn(&[(usize, &TailWalk)]) -> Result<Vec<Landed>> + 'a;

/// A row to draw and its sample's sampler with the log-probabilities its request asks for
/// (`None`: the request has ended).
type Work<'s, 'r> = (Option<(&'s mut Sampler, Option<usize>)>, &'r DrawRow<'r>);

/// The draw of `work`'s row finished where its tail walk `landed` on the backend (the token and
/// its logit; `None`: on the head's last token), with its log-probabilities from the row's
/// reduced terms.
fn land_tail((sampler, row): &mut Work, landed: Landed) -> Outcome {
    let Some((sampler, logprobs)) = sampler else {
        return Outcome::Ended;
    };
    let Some(token) = sampler.land_tail(landed.map(|(t, _)| t)) else {
        return Outcome::Short;
    };
    let logprobs = logprobs.and_then(|n| match landed {
        Some((_, logit)) => row.terms.map(|terms| terms.logprobs(logit, n)),
        None => token_logprobs(row.logits, row.terms, token, n),
    });
    Outcome::Drawn((token, logprobs))
}

/// A drawn token and its log-probabilities.
pub(super) type Drawn = (u32, Option<TokenLogprobs>);

/// What one row's draw came to.
enum Outcome {
    /// Its request has ended.
    Ended,
    /// It landed past its narrowed row: the rest of the row, or the whole row, finishes it.
    Short,
    Drawn(Drawn),
}

/// Sample `sampler`'s token from `row` (its logits may stand in for the row's own), with
/// its log-probabilities where `logprobs` asks: from a whole row, or from the row's reduced
/// terms and the drawn token's logit.
fn draw_one(
    (sampler, logprobs): &mut (&mut Sampler, Option<usize>),
    row: &DrawRow,
    logits: RowLogits,
) -> Outcome {
    let Some(token) = sampler.sample(logits, row.total) else {
        return Outcome::Short;
    };
    // A row that reports log-probabilities is read whole or reduced.
    let logprobs = logprobs.and_then(|n| token_logprobs(logits, row.terms, token, n));
    Outcome::Drawn((token, logprobs))
}

impl Scheduler<'_> {
    /// Each row's token with its log-probabilities where its request asks for them (`None`:
    /// the request has ended, or its row could not be read). Rows are drawn in parallel where
    /// some are whole, a pass over the vocabulary each. Draws by total that land past their
    /// narrowed rows go on over the rest of their rows on the backend where they can
    /// ([`Sampler::tail_walk`]), else read those rows whole and go on over them (`past`, where
    /// the step decoded).
    pub(super) fn draw_rows(
        &mut self,
        rows: &[DrawRow],
        past: Option<PastReads>,
    ) -> Vec<Option<Drawn>> {
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
        // A row's draw from `logits`, its own or its whole row read since.
        let draw = |(sampler, row): &mut Work, logits: RowLogits| match sampler {
            Some(sampler) => draw_one(sampler, row, logits),
            None => Outcome::Ended,
        };
        let whole = |(_, row): &(_, &DrawRow)| matches!(row.logits, RowLogits::Whole(_));
        let began = Instant::now();
        let mut outcomes: Vec<Outcome> = match work.iter().filter(|w| whole(w)).count() > 1 {
            true => work.par_iter_mut().map(|w| draw(w, w.1.logits)).collect(),
            false => work.iter_mut().map(|w| draw(w, w.1.logits)).collect(),
        };
        let asked_whole = (rows.iter())
            .filter(|r| r.place.is_some() && matches!(r.logits, RowLogits::Whole(_)))
            .count();
        let drawn = Instant::now();
        let mut failed = Vec::new();
        // Draws the backend finishes over the rest of their rows, by their places.
        let walks: Vec<(usize, usize, TailWalk)> = (outcomes.iter().enumerate())
            .filter(|(_, o)| matches!(o, Outcome::Short))
            .filter_map(|(i, _)| {
                let walk = work[i].0.as_ref()?.0.tail_walk()?;
                Some((i, rows[i].place?, walk.clone()))
            })
            .collect();
        if let (Some(past), false) = (past, walks.is_empty()) {
            let at: Vec<(usize, &TailWalk)> = walks.iter().map(|(_, p, w)| (*p, w)).collect();
            match (past.walk_tails)(&at) {
                Ok(landed) => {
                    for (&(i, _, _), landed) in walks.iter().zip(landed) {
                        outcomes[i] = land_tail(&mut work[i], landed);
                    }
                    self.status.rows_tail_walked += walks.len() as u64;
                }
                Err(e) => {
                    tracing::error!("walking the rest of rows for their draws: {e}");
                    for &(i, _, _) in &walks {
                        failed.push((rows[i].id, e.to_string()));
                        outcomes[i] = Outcome::Ended;
                    }
                }
            }
        }
        let short: Vec<usize> = (outcomes.iter().enumerate())
            .filter(|(_, o)| matches!(o, Outcome::Short))
            .map(|(i, _)| i)
            .collect();
        let places: Vec<usize> = short.iter().filter_map(|&i| rows[i].place).collect();
        let walked = Instant::now();
        let read = match (past, places.len() == short.len()) {
            _ if short.is_empty() => Ok(None),
            (Some(past), true) => (past.read_whole)(&places).map(Some),
            _ => Err(crate::RuntimeError::Protocol(
                "a draw landed past a row that cannot be read whole".into(),
            )),
        };
        self.status.rows_read_whole += (asked_whole + short.len()) as u64;
        match read {
            Ok(read) => {
                let mut again: Vec<_> = (work.iter_mut().enumerate())
                    .filter(|(i, _)| matches!(outcomes[*i], Outcome::Short))
                    .zip(read.iter().flat_map(WholeRows::rows))
                    .collect();
                let redrawing = Instant::now();
                let redraw = |((i, w), whole): &mut ((usize, &mut Work), &[f32])| {
                    (*i, draw(w, RowLogits::Whole(whole)))
                };
                let redrawn: Vec<(usize, Outcome)> = match again.len() > 1 {
                    true => again.par_iter_mut().map(redraw).collect(),
                    false => again.iter_mut().map(redraw).collect(),
                };
                for (i, outcome) in redrawn {
                    outcomes[i] = outcome;
                }
                tracing::debug!(
                    rows = rows.len(),
                    whole = asked_whole,
                    tails = walks.len(),
                    short = short.len(),
                    draw_ms = ms(drawn - began),
                    tails_ms = ms(walked - drawn),
                    read_ms = ms(redrawing - walked),
                    redraw_ms = ms(redrawing.elapsed()),
                    "draws"
                );
            }
            Err(e) => {
                tracing::error!("reading rows whole for their draws: {e}");
                failed.extend(short.iter().map(|&i| (rows[i].id, e.to_string())));
            }
        }
        drop(work);
        for (id, e) in failed {
            if let Some(mut r) = self.running.remove(&id) {
                r.send(Event::Failed(e));
                self.ending.push(id);
            }
        }
        (outcomes.into_iter())
            .map(|o| match o {
                Outcome::Drawn(drawn) => Some(drawn),
                Outcome::Ended | Outcome::Short => None,
            })
            .collect()
    }
}
