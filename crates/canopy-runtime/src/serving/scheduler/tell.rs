//! Drawn tokens told to their clients.
//!
//! A token's text (the tokenizer's incremental decode) and its event (a channel send that
//! wakes the client's task) cost the host a few microseconds a row: at 64 rows, a few percent
//! of a step in which the device waits. Where a request has no stop strings, its text cannot
//! change which tokens it takes: the token alone (end of sequence, `max_tokens`) decides
//! whether the sample goes on. Such tokens are told after the next pass is launched
//! ([`Scheduler::tell_told`]), while the device runs it. A request with stop strings is told
//! at once, since its text decides whether it takes another step.

use super::{Running, Scheduler};
use crate::sampling::TokenLogprobs;
use crate::serving::handle::{Event, FinishReason};

/// A drawn token whose event is still to be told.
pub(super) struct Told {
    id: u64,
    sample: usize,
    token: u32,
    logprobs: Option<TokenLogprobs>,
    /// Its text, where its request's stop strings needed it at once.
    text: Option<String>,
    /// Why its sample ended with it, if it did.
    reason: Option<FinishReason>,
}

impl Scheduler<'_> {
    /// Takes sample `sample` of request `id`'s drawn `token`: whether the sample goes on is
    /// settled now, and its client is told now (a request with stop strings) or with
    /// [`Scheduler::tell_told`] (module notes).
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
        r.samples[sample].drawn += 1;
        self.status.generated_tokens += 1;
        let (text, stop_string) = match r.submitted.request.stop.is_empty() {
            true => (None, false),
            false => {
                let stops = r.submitted.request.stop.clone();
                let (text, found) = decode_text(r, sample, token, &stops);
                (Some(text), found)
            }
        };
        let request = &r.submitted.request;
        let s = &mut r.samples[sample];
        let reason = if stop_string || (!request.ignore_eos && self.stop_tokens.contains(&token)) {
            Some(FinishReason::Stop)
        } else {
            (s.drawn >= request.max_tokens).then_some(FinishReason::Length)
        };
        match reason {
            None => s.next = Some(token),
            Some(_) => {
                s.next = None;
                s.done = true;
                if r.samples.iter().all(|s| s.done) {
                    // Kept until its last tokens are told; its pages end at the next step.
                    let r = self.running.remove(&id).expect("found above");
                    self.finishing.insert(id, r);
                    self.ending.push(id);
                } else if r.samples[sample].drawn > 1 {
                    self.ended_samples.push((id, sample as u32));
                }
            }
        }
        let told = Told {
            id,
            sample,
            token,
            logprobs,
            text,
            reason,
        };
        match told.text {
            Some(_) => self.tell_one(told),
            None => self.told.push(told),
        }
    }

    /// Tells the clients the tokens [`Scheduler::tell`] kept.
    pub fn tell_told(&mut self) {
        for told in std::mem::take(&mut self.told) {
            self.tell_one(told);
        }
        self.finishing.clear();
    }

    /// Tells a token's client its text and event, and where its sample ended, the rest of its
    /// text. A client found gone cancels its request.
    fn tell_one(&mut self, t: Told) {
        let Some(r) = (self.running.get_mut(&t.id)).or_else(|| self.finishing.get_mut(&t.id))
        else {
            return;
        };
        let text = match t.text {
            Some(text) => text,
            None => decode_text(r, t.sample, t.token, &[]).0,
        };
        let mut alive = r.send(Event::Token {
            sample: t.sample,
            token: t.token,
            text,
            logprobs: t.logprobs,
        });
        if let Some(reason) = t.reason {
            let text = r.samples[t.sample].text.finish();
            alive &= r.send(Event::Finished {
                sample: t.sample,
                reason,
                text,
            });
        }
        if !alive {
            self.cancel(t.id);
        }
    }
}

/// `token` added to sample `sample`'s text: the text now safe to release, and whether one of
/// `stops` ended it. A token the tokenizer cannot decode adds no text; the ids are still the
/// output.
fn decode_text(r: &mut Running, sample: usize, token: u32, stops: &[String]) -> (String, bool) {
    let s = &mut r.samples[sample];
    let piece = s.decoder.push(token).unwrap_or_default();
    s.text.push(&piece, stops)
}
