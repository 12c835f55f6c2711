//! Choosing the next token from logits: greedy at temperature 0, otherwise softmax at the
//! temperature, cut to the `top_k` most likely and to the smallest set whose probability
//! reaches `top_p`, drawn from a seeded generator. Every rank holds the same logits and the
//! same generator, so every rank draws the same token.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// How tokens are drawn.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// 0: greedy (the most likely token, the first of equals).
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens (0: all).
    pub top_k: usize,
    /// Keep the most likely tokens until their probability reaches `top_p` (1: all).
    pub top_p: f32,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
        }
    }
}

/// One sample's generator: sample `i` of a run seeded with `seed` draws from `seed + i`, so
/// it equals the same seed's sample decoded alone.
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
}

impl Sampler {
    pub fn new(params: SamplingParams, seed: u64) -> Sampler {
        Sampler {
            params,
            rng: ChaCha8Rng::seed_from_u64(seed),
        }
    }

    /// The next token from one row of logits.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let p = self.params;
        if p.temperature <= 0.0 {
            return argmax(logits) as u32;
        }
        let mut order: Vec<usize> = (0..logits.len()).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        if p.top_k > 0 {
            order.truncate(p.top_k);
        }
        let max = logits[order[0]];
        let mut probs: Vec<f64> = order
            .iter()
            .map(|&i| (((logits[i] - max) / p.temperature) as f64).exp())
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
            order.truncate(keep);
        }
        let total: f64 = probs.iter().sum();
        let mut draw = self.rng.gen::<f64>() * total;
        for (&i, &x) in order.iter().zip(&probs) {
            if draw < x {
                return i as u32;
            }
            draw -= x;
        }
        order[order.len() - 1] as u32
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
    /// The largest logit and the largest of the rest (the first of equals, as [`argmax`]).
    pub fn of(logits: &[f32]) -> TopTwo {
        let first = argmax(logits);
        let second = logits.iter().enumerate().filter(|&(i, _)| i != first).fold(
            (first, f32::NEG_INFINITY),
            |(bi, bv), (i, &v)| {
                if v > bv {
                    (i, v)
                } else {
                    (bi, bv)
                }
            },
        );
        TopTwo {
            token: first as u32,
            logit: logits.get(first).copied().unwrap_or(f32::NEG_INFINITY),
            second_token: second.0 as u32,
            second_logit: second.1,
        }
    }
}

/// The index of the largest value (the first of equals), as greedy decoding picks.
pub fn argmax(x: &[f32]) -> usize {
    x.iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &v)| {
            if v > bv {
                (i, v)
            } else {
                (bi, bv)
            }
        })
        .0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_two_names_the_two_largest() {
        let t = TopTwo::of(&[0.5, 3.0, -1.0, 2.5, 3.0]);
        assert_eq!((t.token, t.logit), (1, 3.0));
        assert_eq!((t.second_token, t.second_logit), (4, 3.0));
        let t = TopTwo::of(&[1.0, 0.0]);
        assert_eq!((t.second_token, t.second_logit), (1, 0.0));
    }

    #[test]
    fn temperature_zero_is_argmax() {
        let mut s = Sampler::new(SamplingParams::default(), 1);
        assert_eq!(s.sample(&[0.1, 3.0, 2.0, 3.0]), 1);
    }

    #[test]
    fn top_k_one_is_greedy_and_seeds_repeat() {
        let logits: Vec<f32> = (0..50).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
        let greedy = argmax(&logits) as u32;
        let params = SamplingParams {
            temperature: 0.8,
            top_k: 1,
            top_p: 1.0,
        };
        assert_eq!(Sampler::new(params, 3).sample(&logits), greedy);
        let params = SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.9,
        };
        let draw = |seed| {
            let mut s = Sampler::new(params, seed);
            (0..20).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(draw(5), draw(5));
        assert_ne!(draw(5), draw(6));
    }

    #[test]
    fn top_p_keeps_only_the_likely_head() {
        let mut logits = vec![-10.0f32; 10];
        logits[4] = 5.0;
        let params = SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.5,
        };
        let mut s = Sampler::new(params, 9);
        assert!((0..50).all(|_| s.sample(&logits) == 4));
    }
}
