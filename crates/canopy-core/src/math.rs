//! Exact attention math: partial states, their merge and the f64 oracle.
//!
//! # Conventions (every backend, every API)
//! - A partial state for one (row, query head) is `(o, lse)`: `o` is **normalised** by the
//!   partial's own softmax denominator (so it is a convex combination of V rows) and `lse` is
//!   the **natural-log** sum of exponentials of the scaled scores. Both are fp32.
//! - The empty partial (no keys) is `o = 0, lse = -inf`. [`merge_state`] is total: empties
//!   merge to the empty partial (never `-inf - -inf = NaN`) and the empty partial is the
//!   identity. Merging is associative and commutative up to rounding.

use crate::data::KvSource;
use crate::shape::AttnShape;
use crate::tree::KvTree;

/// The `lse` of the empty partial.
pub const EMPTY_LSE: f32 = f32::NEG_INFINITY;

/// Partial (or final) attention states: `rows × heads` of `(o[head_dim], lse)`.
#[derive(Debug, Clone, PartialEq)]
pub struct AttnStates {
    pub rows: usize,
    pub heads: usize,
    pub head_dim: usize,
    /// `rows × heads × head_dim`, normalised.
    pub o: Vec<f32>,
    /// `rows × heads`, natural log.
    pub lse: Vec<f32>,
}

impl AttnStates {
    /// All-empty states.
    pub fn empty(rows: usize, heads: usize, head_dim: usize) -> Self {
        AttnStates {
            rows,
            heads,
            head_dim,
            o: vec![0.0; rows * heads * head_dim],
            lse: vec![EMPTY_LSE; rows * heads],
        }
    }

    pub fn o_of(&self, row: usize, head: usize) -> &[f32] {
        let i = (row * self.heads + head) * self.head_dim;
        &self.o[i..i + self.head_dim]
    }

    /// Merges `other[row_b]` into `self[row_a]` for every head.
    pub fn merge_row_from(&mut self, row_a: usize, other: &AttnStates, row_b: usize) {
        let (h, d) = (self.heads, self.head_dim);
        for head in 0..h {
            let a = row_a * h + head;
            let b = row_b * h + head;
            merge_state(
                &mut self.o[a * d..(a + 1) * d],
                &mut self.lse[a],
                &other.o[b * d..(b + 1) * d],
                other.lse[b],
            );
        }
    }

    /// Merges every row of `other` into the same row of `self`.
    pub fn merge_from(&mut self, other: &AttnStates) {
        debug_assert_eq!(
            (self.rows, self.heads, self.head_dim),
            (other.rows, other.heads, other.head_dim)
        );
        for r in 0..self.rows {
            self.merge_row_from(r, other, r);
        }
    }
}

/// Merges the partial `(o_b, lse_b)` into `(o_a, lse_a)`. Total: see the module notes.
#[inline]
pub fn merge_state(o_a: &mut [f32], lse_a: &mut f32, o_b: &[f32], lse_b: f32) {
    if lse_b == EMPTY_LSE {
        return;
    }
    if *lse_a == EMPTY_LSE {
        o_a.copy_from_slice(o_b);
        *lse_a = lse_b;
        return;
    }
    let m = lse_a.max(lse_b);
    let wa = (*lse_a - m).exp();
    let wb = (lse_b - m).exp();
    let inv = 1.0 / (wa + wb);
    for (a, &b) in o_a.iter_mut().zip(o_b) {
        *a = (*a * wa + b * wb) * inv;
    }
    *lse_a = m + (wa + wb).ln();
}

/// Relative error `‖got − want‖₂ / ‖want‖₂` over outputs (and NaN when any output is NaN).
pub fn relative_error(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let mut num = 0.0f64;
    let mut den = 0.0f64;
    for (&g, &w) in got.iter().zip(want) {
        if g.is_nan() {
            return f64::NAN;
        }
        num += (g as f64 - w) * (g as f64 - w);
        den += w * w;
    }
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}

/// The oracle: exact attention in f64 for every query of `tree`, straight from the tree (no
/// plan), with K and V rows from `kv` and queries `q` (`queries × q_heads × head_dim`).
/// Returns `(o, lse)` as f64. Parallel over (query, head) pairs.
pub fn reference_attention(
    tree: &KvTree,
    shape: &AttnShape,
    q: &[f32],
    kv: &impl KvSource,
) -> (Vec<f64>, Vec<f64>) {
    use rayon::prelude::*;
    let (h, d) = (shape.q_heads, shape.head_dim);
    let g = shape.group_size();
    let scale = shape.softmax_scale() as f64;
    let nq = tree.num_queries();
    let cells: Vec<(Vec<f64>, f64)> = (0..nq * h)
        .into_par_iter()
        .map(|cell| {
            let (qi, head) = (cell / h, cell % h);
            let qv = &q[cell * d..(cell + 1) * d];
            let (mut k, mut v) = (vec![0.0f32; d], vec![0.0f32; d]);
            // One pass with a running max (rescaling in f64 is exact enough for an oracle).
            let (mut m, mut sum) = (f64::NEG_INFINITY, 0.0f64);
            let mut out = vec![0.0f64; d];
            for r in tree.query_context(qi as u32) {
                for t in r {
                    kv.rows(t as usize, head / g, &mut k, &mut v);
                    let s = qv
                        .iter()
                        .zip(&k)
                        .map(|(&a, &b)| a as f64 * b as f64)
                        .sum::<f64>()
                        * scale;
                    if s > m {
                        let c = (m - s).exp();
                        sum *= c;
                        out.iter_mut().for_each(|x| *x *= c);
                        m = s;
                    }
                    let p = (s - m).exp();
                    sum += p;
                    out.iter_mut()
                        .zip(&v)
                        .for_each(|(x, &vv)| *x += p * vv as f64);
                }
            }
            if sum == 0.0 {
                (out, f64::NEG_INFINITY)
            } else {
                out.iter_mut().for_each(|x| *x /= sum);
                (out, m + sum.ln())
            }
        })
        .collect();
    let mut o = Vec::with_capacity(nq * h * d);
    let mut lse = Vec::with_capacity(nq * h);
    for (cell_o, cell_lse) in cells {
        o.extend(cell_o);
        lse.push(cell_lse);
    }
    (o, lse)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merging_empties_is_total() {
        let mut o = [0.0f32; 4];
        let mut lse = EMPTY_LSE;
        merge_state(&mut o, &mut lse, &[0.0; 4], EMPTY_LSE);
        assert_eq!(lse, EMPTY_LSE);
        assert!(o.iter().all(|x| *x == 0.0));
        merge_state(&mut o, &mut lse, &[1.0, 2.0, 3.0, 4.0], 0.5);
        assert_eq!((o, lse), ([1.0, 2.0, 3.0, 4.0], 0.5));
        merge_state(&mut o, &mut lse, &[9.0; 4], EMPTY_LSE);
        assert_eq!((o, lse), ([1.0, 2.0, 3.0, 4.0], 0.5));
    }

    #[test]
    fn merging_equal_weights_averages() {
        let mut o = [1.0f32, 0.0];
        let mut lse = 0.0;
        merge_state(&mut o, &mut lse, &[0.0, 1.0], 0.0);
        assert_eq!(o, [0.5, 0.5]);
        assert!((lse - 2f32.ln()).abs() < 1e-7);
    }

    #[test]
    fn relative_error_flags_nan() {
        assert!(relative_error(&[f32::NAN], &[1.0]).is_nan());
        assert!(relative_error(&[1.0], &[1.0]) == 0.0);
    }
}
