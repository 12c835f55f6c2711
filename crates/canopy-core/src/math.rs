//! Exact attention math: partial states, their merge, the f64 oracle and the blocked f32
//! flash-decoding kernel the CPU backend runs.
//!
//! # Conventions (every backend, every API)
//! - A partial state for one (row, query head) is `(o, lse)`: `o` is **normalised** by the
//!   partial's own softmax denominator (so it is a convex combination of V rows) and `lse` is
//!   the **natural-log** sum of exponentials of the scaled scores. Both are fp32.
//! - The empty partial (no keys) is `o = 0, lse = -inf`. [`merge_state`] is total: empties
//!   merge to the empty partial (never `-inf - -inf = NaN`) and the empty partial is the
//!   identity. Merging is associative and commutative up to rounding.

use crate::data::KvSource;
use crate::dtype::KvElement;
use crate::plan::Group;
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

/// `a · b` in eight partial sums, which the compiler keeps in vector registers; a sum in
/// order is one dependent chain of scalar adds.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    const LANES: usize = 8;
    let (a8, b8) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = a8
        .remainder()
        .iter()
        .zip(b8.remainder())
        .map(|(x, y)| x * y)
        .sum();
    let mut lanes = [0.0f32; LANES];
    for (x, y) in a8.zip(b8) {
        for l in 0..LANES {
            lanes[l] += x[l] * y[l];
        }
    }
    lanes.iter().sum::<f32>() + tail
}

/// Tokens per block of the f32 flash-decoding kernel.
const BLOCK: usize = 64;

/// Stage 1 of flash decoding on the CPU for one group: writes the group's partial rows
/// (`group.queries.len()` rows starting at row 0 of `out_o` / `out_lse`, each `q_heads` wide).
///
/// Blocked online softmax: per block of tokens, all of a KV head's GQA query rows score the
/// block (each K/V element is widened once per block, not once per query), then the running
/// max, denominator and accumulator are rescaled once per block.
pub fn group_partial<E: KvElement>(
    shape: &AttnShape,
    group: &Group,
    q: &[f32],
    k: &[E],
    v: &[E],
    out_o: &mut [f32],
    out_lse: &mut [f32],
) {
    let (h, hk, d) = (shape.q_heads, shape.kv_heads, shape.head_dim);
    let g = shape.group_size();
    let scale = shape.softmax_scale();
    let nq = group.queries.len();
    let rows = nq * g; // rows per KV head: every (query, q head of this KV head)
    let mut kbuf = vec![0.0f32; BLOCK * d];
    let mut vbuf = vec![0.0f32; BLOCK * d];
    let mut s = vec![0.0f32; rows * BLOCK];
    let mut acc = vec![0.0f32; rows * d];
    let mut m = vec![f32::NEG_INFINITY; rows];
    let mut l = vec![0.0f32; rows];
    // Token positions within the group, as (address, group-token index) blocks.
    let tokens: Vec<(u32, usize)> = group
        .kv
        .iter()
        .flat_map(|r| r.clone())
        .enumerate()
        .map(|(i, a)| (a, i))
        .collect();
    for kvh in 0..hk {
        acc.fill(0.0);
        m.fill(f32::NEG_INFINITY);
        l.fill(0.0);
        for block in tokens.chunks(BLOCK) {
            let n = block.len();
            for (i, &(addr, _)) in block.iter().enumerate() {
                let src = (addr as usize * hk + kvh) * d;
                for c in 0..d {
                    kbuf[i * d + c] = k[src + c].to_f32();
                    vbuf[i * d + c] = v[src + c].to_f32();
                }
            }
            for j in 0..nq {
                let qrow = group.queries[j] as usize;
                for gi in 0..g {
                    let row = j * g + gi;
                    let head = kvh * g + gi;
                    let qv = &q[(qrow * h + head) * d..][..d];
                    let srow = &mut s[row * BLOCK..row * BLOCK + n];
                    let mut block_max = f32::NEG_INFINITY;
                    for (i, &(_, ti)) in block.iter().enumerate() {
                        srow[i] = if group.visible(ti, j) {
                            let kr = &kbuf[i * d..(i + 1) * d];
                            dot(qv, kr) * scale
                        } else {
                            f32::NEG_INFINITY
                        };
                        block_max = block_max.max(srow[i]);
                    }
                    if block_max == f32::NEG_INFINITY {
                        continue; // every token of the block is masked for this row
                    }
                    let new_m = m[row].max(block_max);
                    let correction = (m[row] - new_m).exp();
                    let a = &mut acc[row * d..(row + 1) * d];
                    if correction != 1.0 {
                        a.iter_mut().for_each(|x| *x *= correction);
                    }
                    let mut sum = l[row] * correction;
                    for (i, &sc) in srow.iter().enumerate() {
                        let p = (sc - new_m).exp();
                        if p == 0.0 {
                            continue;
                        }
                        sum += p;
                        for (x, &vv) in a.iter_mut().zip(&vbuf[i * d..(i + 1) * d]) {
                            *x += p * vv;
                        }
                    }
                    l[row] = sum;
                    m[row] = new_m;
                }
            }
        }
        for j in 0..nq {
            for gi in 0..g {
                let row = j * g + gi;
                let head = kvh * g + gi;
                let dst = (j * h + head) * d;
                if l[row] == 0.0 {
                    out_o[dst..dst + d].fill(0.0);
                    out_lse[j * h + head] = EMPTY_LSE;
                } else {
                    let inv = 1.0 / l[row];
                    for (o, &a) in out_o[dst..dst + d]
                        .iter_mut()
                        .zip(&acc[row * d..(row + 1) * d])
                    {
                        *o = a * inv;
                    }
                    out_lse[j * h + head] = m[row] + l[row].ln();
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The eight partial sums and the tail cover every element, at lengths around the lanes.
    #[test]
    fn dot_equals_the_f64_product_at_every_length() {
        for len in 0..27 {
            let a: Vec<f32> = (0..len).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..len).map(|i| 1.0 + i as f32 * 0.5).collect();
            let want: f64 = a.iter().zip(&b).map(|(&x, &y)| x as f64 * y as f64).sum();
            assert!((dot(&a, &b) as f64 - want).abs() < 1e-5, "length {len}");
        }
    }

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
