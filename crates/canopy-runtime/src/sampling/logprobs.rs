//! A token's log-probability under the model, from its whole row or from terms reduced on the
//! backend, and a row's two likeliest tokens.

use super::RowLogits;
use canopy_core::logits::top_tokens;

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

/// `token`'s log-probabilities with its row's `n` likeliest: from the row's reduced `terms`
/// and the token's logit in `row`, or from `row` whole (`None`: a narrowed row without its
/// terms, or one without the token).
pub fn token_logprobs(
    row: RowLogits,
    terms: Option<&RowTerms>,
    token: u32,
    n: usize,
) -> Option<TokenLogprobs> {
    let logit = match row {
        RowLogits::Whole(logits) => logits.get(token as usize).copied(),
        RowLogits::Top {
            tokens,
            logits,
            picked,
        } => (tokens.iter().position(|&t| t == token).map(|i| logits[i]))
            .or_else(|| picked.iter().find(|&&(t, _)| t == token).map(|&(_, x)| x)),
    };
    match (terms, row) {
        (Some(terms), _) => logit.map(|x| terms.logprobs(x, n)),
        (None, RowLogits::Whole(logits)) => Some(TokenLogprobs::of(logits, token, n)),
        (None, RowLogits::Top { .. }) => None,
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
            RowLogits::Top { tokens, logits, .. } => (tokens.to_vec(), logits.to_vec()),
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
    use super::super::tests::narrowed;
    use super::*;

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
}
