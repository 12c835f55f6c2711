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

/// Tokens of a group's KV that one task of [`group_partial`] covers at most. A long group
/// (one sequence's whole context) is cut into pieces that run on every core and are merged,
/// where it would otherwise take one core for each KV head. The cut depends on the group
/// alone, never on the threads, so a group's result does not depend on the machine.
const PIECE: usize = 8 * BLOCK;

/// Stage 1 of flash decoding on the CPU for one group: writes the group's partial rows
/// (`group.queries.len()` rows starting at row 0 of `out_o` / `out_lse`, each `q_heads` wide).
///
/// Each KV head and piece of at most [`PIECE`] tokens is a task of its own (in parallel on
/// rayon); a head's pieces are then merged in token order. A group of at most [`PIECE`]
/// tokens is one piece a head, its rows written as the piece computed them.
pub fn group_partial<E: KvElement>(
    shape: &AttnShape,
    group: &Group,
    q: &[f32],
    k: &[E],
    v: &[E],
    out_o: &mut [f32],
    out_lse: &mut [f32],
) {
    use rayon::prelude::*;
    let (h, hk, d) = (shape.q_heads, shape.kv_heads, shape.head_dim);
    let g = shape.group_size();
    let nq = group.queries.len();
    // Token positions within the group, as (address, group-token index).
    let tokens: Vec<(u32, usize)> = group
        .kv
        .iter()
        .flat_map(|r| r.clone())
        .enumerate()
        .map(|(i, a)| (a, i))
        .collect();
    let pieces = tokens.len().div_ceil(PIECE).max(1);
    let mut partials: Vec<HeadPartial> = (0..hk * pieces)
        .into_par_iter()
        .map(|task| {
            let (kv_head, piece) = (task / pieces, task % pieces);
            let begin = (piece * PIECE).min(tokens.len());
            let end = (begin + PIECE).min(tokens.len());
            head_partial(shape, group, kv_head, &tokens[begin..end], q, k, v)
        })
        .collect();
    for (kv_head, head) in partials.chunks_mut(pieces).enumerate() {
        let (first, rest) = head.split_first_mut().expect("one piece at least");
        for later in rest.iter() {
            for row in 0..nq * g {
                merge_state(
                    &mut first.o[row * d..(row + 1) * d],
                    &mut first.lse[row],
                    &later.o[row * d..(row + 1) * d],
                    later.lse[row],
                );
            }
        }
        for j in 0..nq {
            for gi in 0..g {
                let (row, head) = (j * g + gi, kv_head * g + gi);
                out_o[(j * h + head) * d..][..d].copy_from_slice(&first.o[row * d..][..d]);
                out_lse[j * h + head] = first.lse[row];
            }
        }
    }
}

/// One KV head's normalised partial over some of a group's tokens: `o` is `rows × head_dim`
/// and `lse` is `rows`, a row each (query, GQA head of the KV head).
struct HeadPartial {
    o: Vec<f32>,
    lse: Vec<f32>,
}

/// The blocked online softmax of one KV head over `tokens` (address, group-token index):
/// per block of tokens, all of the head's GQA query rows score the block (each K/V element
/// is read once per block, not once per query), then the running max, denominator and
/// accumulator are rescaled once per block. f32 K and V are read where they lie; other
/// dtypes are widened once per block.
fn head_partial<E: KvElement>(
    shape: &AttnShape,
    group: &Group,
    kv_head: usize,
    tokens: &[(u32, usize)],
    q: &[f32],
    k: &[E],
    v: &[E],
) -> HeadPartial {
    let (h, hk, d) = (shape.q_heads, shape.kv_heads, shape.head_dim);
    let g = shape.group_size();
    let scale = shape.softmax_scale();
    let nq = group.queries.len();
    let rows = nq * g; // every (query, q head of this KV head)
    let in_f32: Option<(&[f32], &[f32])> = (E::DTYPE == crate::dtype::DType::F32)
        .then(|| (bytemuck::cast_slice(k), bytemuck::cast_slice(v)));
    let widened = if in_f32.is_some() { 0 } else { BLOCK * d };
    let (mut kbuf, mut vbuf) = (vec![0.0f32; widened], vec![0.0f32; widened]);
    let mut s = vec![0.0f32; rows * BLOCK];
    let mut acc = vec![0.0f32; rows * d];
    let mut m = vec![f32::NEG_INFINITY; rows];
    let mut l = vec![0.0f32; rows];
    let row_start = |addr: u32| (addr as usize * hk + kv_head) * d;
    for block in tokens.chunks(BLOCK) {
        let n = block.len();
        if in_f32.is_none() {
            for (i, &(addr, _)) in block.iter().enumerate() {
                let src = row_start(addr);
                for c in 0..d {
                    kbuf[i * d + c] = k[src + c].to_f32();
                    vbuf[i * d + c] = v[src + c].to_f32();
                }
            }
        }
        // Token `i` of the block's key and value rows.
        let kv_row = |i: usize| -> (&[f32], &[f32]) {
            match in_f32 {
                Some((k, v)) => {
                    let src = row_start(block[i].0);
                    (&k[src..src + d], &v[src..src + d])
                }
                None => (&kbuf[i * d..(i + 1) * d], &vbuf[i * d..(i + 1) * d]),
            }
        };
        for j in 0..nq {
            let qrow = group.queries[j] as usize;
            for gi in 0..g {
                let row = j * g + gi;
                let head = kv_head * g + gi;
                let qv = &q[(qrow * h + head) * d..][..d];
                let srow = &mut s[row * BLOCK..row * BLOCK + n];
                let mut block_max = f32::NEG_INFINITY;
                for (i, &(_, ti)) in block.iter().enumerate() {
                    srow[i] = if group.visible(ti, j) {
                        dot(qv, kv_row(i).0) * scale
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
                    for (x, &vv) in a.iter_mut().zip(kv_row(i).1) {
                        *x += p * vv;
                    }
                }
                l[row] = sum;
                m[row] = new_m;
            }
        }
    }
    let mut lse = vec![EMPTY_LSE; rows];
    for row in 0..rows {
        let a = &mut acc[row * d..(row + 1) * d];
        if l[row] == 0.0 {
            a.fill(0.0);
        } else {
            let inv = 1.0 / l[row];
            a.iter_mut().for_each(|x| *x *= inv);
            lse[row] = m[row] + l[row].ln();
        }
    }
    HeadPartial { o: acc, lse }
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

    /// A group longer than a piece is cut, its pieces run apart and merged: every row still
    /// equals the f64 softmax over the tokens it sees, for f32 K and V (read where they lie)
    /// and bf16 (widened). One query sees nothing of the last piece, another nothing at all.
    #[test]
    fn a_group_cut_into_pieces_equals_the_f64_softmax() {
        let shape = AttnShape::new(6, 2, 64).unwrap();
        let (h, hk, d) = (shape.q_heads, shape.kv_heads, shape.head_dim);
        let kv = vec![0..700u32, 900..1500];
        let tokens: Vec<u32> = kv.iter().flat_map(|r| r.clone()).collect();
        assert!(tokens.len() > 2 * PIECE && !tokens.len().is_multiple_of(PIECE));
        // Query 0 sees every token, query 1 the first 1,000, query 2 none.
        let sees = |t: usize, j: usize| j == 0 || (j == 1 && t < 1000);
        let mask = (0..tokens.len())
            .map(|t| (0..3).filter(|&j| sees(t, j)).map(|j| 1u64 << j).sum())
            .collect();
        let group = Group {
            kv,
            queries: vec![2, 0, 1],
            mask: Some(mask),
        };
        let mut seed = 0x2545_f491_u64;
        let mut draw = || {
            seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            ((seed >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
        };
        let elems = 1500 * hk * d;
        let k: Vec<f32> = (0..elems).map(|_| draw()).collect();
        let v: Vec<f32> = (0..elems).map(|_| draw()).collect();
        let q: Vec<f32> = (0..3 * h * d).map(|_| draw()).collect();
        let (k16, v16): (Vec<half::bf16>, Vec<half::bf16>) = (
            k.iter().map(|&x| half::bf16::from_f32(x)).collect(),
            v.iter().map(|&x| half::bf16::from_f32(x)).collect(),
        );
        let check = |o: &[f32], lse: &[f32], k: &dyn Fn(usize) -> f64, v: &dyn Fn(usize) -> f64| {
            for j in 0..3 {
                for head in 0..h {
                    let qv = &q[(group.queries[j] as usize * h + head) * d..][..d];
                    let row = |t: u32| (t as usize * hk + head / shape.group_size()) * d;
                    let scores: Vec<(u32, f64)> = (tokens.iter().enumerate())
                        .filter(|&(ti, _)| sees(ti, j))
                        .map(|(_, &t)| {
                            let s: f64 = (0..d).map(|c| qv[c] as f64 * k(row(t) + c)).sum();
                            (t, s * shape.softmax_scale() as f64)
                        })
                        .collect();
                    let (o, lse) = (&o[(j * h + head) * d..][..d], lse[j * h + head]);
                    if scores.is_empty() {
                        assert!(lse == EMPTY_LSE && o.iter().all(|&x| x == 0.0));
                        continue;
                    }
                    let m = scores.iter().map(|s| s.1).fold(f64::NEG_INFINITY, f64::max);
                    let total: f64 = scores.iter().map(|s| (s.1 - m).exp()).sum();
                    assert!(
                        (lse as f64 - (m + total.ln())).abs() < 1e-4,
                        "lse {j} {head}"
                    );
                    for (c, &got) in o.iter().enumerate() {
                        let want: f64 = (scores.iter())
                            .map(|&(t, s)| (s - m).exp() / total * v(row(t) + c))
                            .sum();
                        assert!((got as f64 - want).abs() < 1e-5, "o {j} {head} {c}");
                    }
                }
            }
        };
        let (mut o, mut lse) = (vec![f32::NAN; 3 * h * d], vec![f32::NAN; 3 * h]);
        group_partial(&shape, &group, &q, &k, &v, &mut o, &mut lse);
        check(&o, &lse, &|i| k[i] as f64, &|i| v[i] as f64);
        let (mut o, mut lse) = (vec![f32::NAN; 3 * h * d], vec![f32::NAN; 3 * h]);
        group_partial(&shape, &group, &q, &k16, &v16, &mut o, &mut lse);
        check(&o, &lse, &|i| k16[i].to_f64(), &|i| v16[i].to_f64());
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
