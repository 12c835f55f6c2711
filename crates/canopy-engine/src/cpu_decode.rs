//! Stage 1 of flash decoding on the CPU: each group of a plan into its partial rows, as the
//! GPU's `decode_partial` writes them (normalised `o`, natural-log `lse`).
//!
//! A group is cut into pieces of its tokens that run on every core, and each head's pieces
//! are merged in token order. A piece takes its tokens in blocks of [`BLOCK`] keys through the
//! online softmax of [`flash`], every KV head of a block in turn: the pool holds a token's
//! keys (and values) for all heads in one row, so a piece reads its tokens' rows whole and in
//! order, where a task of one head would read a strided part of each. All of a head's query
//! rows (queries × GQA heads) score the block at once, so each key and value is read once per
//! block, not once per row. From [`GEMM_ROWS`] rows (queries that share a prefix) a block's
//! two products run on `gemm`.

use crate::host_ops::flash::{self, OnlineSoftmax, Products, Rows};
use canopy_core::{merge_state, AttnShape, Group, KvElement};
use rayon::prelude::*;
use std::ops::Range;

/// Keys a block of the online softmax takes.
const BLOCK: usize = 64;

/// Tokens of a group's KV that one task covers at most. A long group (one sequence's whole
/// context) is cut into pieces that run on every core. The cut depends on the group's length
/// alone, never on the threads, so a group's result does not depend on the machine.
const PIECE: usize = 8 * BLOCK;

/// Pieces a group is cut into at least, where it has that many blocks: a group shorter than
/// a few [`PIECE`]s still runs on several cores.
const MIN_PIECES: usize = 16;

/// Query rows of a KV head from which a block's products run on `gemm`; fewer take dot
/// products and row additions, which cost less than a `gemm` call at that size.
const GEMM_ROWS: usize = 16;

/// Writes `group`'s partial rows: `group.queries.len()` rows from row 0 of `out_o` and
/// `out_lse`, each `q_heads` wide. `q` is every query's rows (`queries × q_heads × head_dim`),
/// `k` and `v` the pool (`tokens × kv_heads × head_dim`), addressed by the group's ranges.
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
    let nq = group.queries.len();
    // Token positions within the group, as (address, group-token index).
    let tokens: Vec<(u32, usize)> = group
        .kv
        .iter()
        .flat_map(|r| r.clone())
        .enumerate()
        .map(|(i, a)| (a, i))
        .collect();
    let mut partials: Vec<Vec<HeadState>> = pieces(tokens.len())
        .into_par_iter()
        .map(|piece| piece_partial(shape, group, &tokens[piece], q, k, v))
        .collect();
    let (first, later) = partials.split_first_mut().expect("one piece at least");
    for (kv_head, (o, lse)) in first.iter_mut().enumerate() {
        for (later_o, later_lse) in later.iter().map(|piece| &piece[kv_head]) {
            for row in 0..nq * g {
                let at = row * d..(row + 1) * d;
                merge_state(
                    &mut o[at.clone()],
                    &mut lse[row],
                    &later_o[at],
                    later_lse[row],
                );
            }
        }
        for j in 0..nq {
            for gi in 0..g {
                let (row, head) = (j * g + gi, kv_head * g + gi);
                out_o[(j * h + head) * d..][..d].copy_from_slice(&o[row * d..][..d]);
                out_lse[j * h + head] = lse[row];
            }
        }
    }
    debug_assert_eq!(first.len(), hk);
}

/// The token ranges a group of `tokens` is cut into: whole blocks, at most [`PIECE`] tokens
/// each, and at least [`MIN_PIECES`] of them where the group has the blocks. One range, empty,
/// for an empty group.
fn pieces(tokens: usize) -> Vec<Range<usize>> {
    let blocks = tokens.div_ceil(BLOCK).max(1);
    let pieces = blocks.div_ceil(PIECE / BLOCK).max(MIN_PIECES.min(blocks));
    let token_at = |piece: usize| (piece * blocks / pieces * BLOCK).min(tokens);
    (0..pieces).map(|i| token_at(i)..token_at(i + 1)).collect()
}

/// One KV head's normalised partial: `o` (`rows × head_dim`) and `lse` (`rows`), row
/// `j · g + gi` being query `j`'s GQA head `gi` of the KV head.
type HeadState = (Vec<f32>, Vec<f32>);

/// Every KV head's normalised partial over `tokens` (address, group-token index) of `group`.
/// The heads of a block are taken together, so a task reads each token's keys and values for
/// all heads, one contiguous row, as the pool lays them out.
fn piece_partial<E: KvElement>(
    shape: &AttnShape,
    group: &Group,
    tokens: &[(u32, usize)],
    q: &[f32],
    k: &[E],
    v: &[E],
) -> Vec<HeadState> {
    let (h, hk, d) = (shape.q_heads, shape.kv_heads, shape.head_dim);
    let g = shape.group_size();
    let nq = group.queries.len();
    let rows = nq * g;
    let by = if rows >= GEMM_ROWS {
        Products::Gemm
    } else {
        Products::Loops
    };
    // Each KV head's query rows, contiguous: a query's GQA heads of one KV head are adjacent.
    let mut q_rows = vec![0.0f32; hk * rows * d];
    for (kv_head, head_rows) in q_rows.chunks_mut(rows * d).enumerate() {
        for (j, &query) in group.queries.iter().enumerate() {
            let src = (query as usize * h + kv_head * g) * d;
            head_rows[j * g * d..(j + 1) * g * d].copy_from_slice(&q[src..src + g * d]);
        }
    }
    let scale = shape.softmax_scale();
    let token_width = hk * d;
    let in_place = E::as_f32(k).zip(E::as_f32(v));
    // Filled only where a block is gathered.
    let (mut k_block, mut v_block) = (Vec::new(), Vec::new());
    let mut scores = vec![0.0f32; rows * BLOCK];
    let mut states: Vec<OnlineSoftmax> = (0..hk).map(|_| OnlineSoftmax::new(rows, d)).collect();
    for (b, block) in tokens.chunks(BLOCK).enumerate() {
        let n = block.len();
        let consecutive = block.windows(2).all(|w| w[1].0 == w[0].0 + 1);
        // The next block's f32 keys and values are asked for while this one is computed;
        // otherwise the products wait on memory a row at a time (a step at 32K of context
        // took 20% longer on 16 cores).
        if let Some((k, v)) = in_place {
            let next = &tokens[((b + 1) * BLOCK).min(tokens.len())..];
            for &(addr, _) in next.iter().take(BLOCK) {
                let at = addr as usize * token_width;
                for c in (0..token_width).step_by(LINE_FLOATS) {
                    prefetch(&k[at + c]);
                    prefetch(&v[at + c]);
                }
            }
        }
        // f32 keys and values at consecutive addresses are read where they lie; others are
        // gathered (and widened) into the block's buffers.
        let (k_rows, v_rows) = match in_place {
            Some((k, v)) if consecutive => {
                let first = block[0].0 as usize * token_width;
                (&k[first..], &v[first..])
            }
            _ => {
                k_block.resize(BLOCK * token_width, 0.0);
                v_block.resize(BLOCK * token_width, 0.0);
                for (i, &(addr, _)) in block.iter().enumerate() {
                    let src = addr as usize * token_width;
                    let dst = i * token_width..(i + 1) * token_width;
                    for (x, &y) in k_block[dst.clone()].iter_mut().zip(&k[src..]) {
                        *x = y.to_f32();
                    }
                    for (x, &y) in v_block[dst].iter_mut().zip(&v[src..]) {
                        *x = y.to_f32();
                    }
                }
                (&k_block[..], &v_block[..])
            }
        };
        for (kv_head, state) in states.iter_mut().enumerate() {
            let q_rows = Rows::at(&q_rows, kv_head * rows * d, d);
            let k_rows = Rows::at(k_rows, kv_head * d, token_width);
            let scores = &mut scores[..rows * n];
            flash::scores(q_rows, k_rows, (rows, n, d), scale, by, scores);
            if group.mask.is_some() {
                for (row, row_scores) in scores.chunks_mut(n).enumerate() {
                    for (s, &(_, token)) in row_scores.iter_mut().zip(block) {
                        if !group.visible(token, row / g) {
                            *s = f32::NEG_INFINITY;
                        }
                    }
                }
            }
            state.absorb(scores, n, Rows::at(v_rows, kv_head * d, token_width), by);
        }
    }
    states.into_iter().map(OnlineSoftmax::finish).collect()
}

/// f32 values in a 64-byte cache line.
const LINE_FLOATS: usize = 16;

/// Asks for the cache line of `x` ahead of its use, into L2. A block's f32 keys and values at
/// head dim 64 are 32 KB, a whole L1 of many CPUs: asked into L1, the next block's evicted
/// this one's (a SmolLM2 step at 4K of context took 7-37% longer in five rounds on two cores).
#[inline(always)]
fn prefetch(x: &f32) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch reads nothing the program sees; SSE is part of x86_64.
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
        _mm_prefetch::<_MM_HINT_T1>(x as *const f32 as *const i8);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use canopy_core::{DType, TypedVec, EMPTY_LSE};

    /// Pieces are whole blocks, at most [`PIECE`] tokens, cover the group in order, and
    /// number at least [`MIN_PIECES`] where the group has that many blocks.
    #[test]
    fn pieces_are_whole_blocks_and_enough_for_several_cores() {
        assert_eq!(pieces(0), vec![0..0]);
        for tokens in (1..3000).chain([8191, 8192, 8193, 32768, 100_000]) {
            let cut = pieces(tokens);
            let blocks = tokens.div_ceil(BLOCK);
            assert!(
                cut.len() >= MIN_PIECES.min(blocks),
                "{tokens} tokens: {cut:?}"
            );
            assert_eq!(
                cut.len(),
                tokens.div_ceil(PIECE).max(MIN_PIECES.min(blocks))
            );
            assert_eq!((cut[0].start, cut[cut.len() - 1].end), (0, tokens));
            for (piece, next) in cut.iter().zip(&cut[1..]) {
                assert_eq!(piece.end, next.start, "{tokens} tokens: {cut:?}");
            }
            for piece in &cut {
                assert!(
                    !piece.is_empty() && piece.len() <= PIECE,
                    "{tokens}: {piece:?}"
                );
                assert!(
                    piece.start.is_multiple_of(BLOCK),
                    "{tokens} tokens: {piece:?}"
                );
            }
        }
    }

    /// Groups longer than a piece are cut, their pieces run apart and merged: every row
    /// equals the f64 softmax over the tokens it sees, for f32 K and V (read where they lie)
    /// and bf16 (widened), on consecutive addresses and across ranges, with few rows (dot
    /// products) and many (`gemm`). A query sees nothing of the last piece, another nothing.
    #[test]
    fn groups_cut_into_pieces_equal_the_f64_softmax() {
        let shape = AttnShape::new(6, 2, 64).unwrap();
        let (h, hk, d) = (shape.q_heads, shape.kv_heads, shape.head_dim);
        let kv = vec![0..700u32, 901..1500];
        let tokens: Vec<u32> = kv.iter().flat_map(|r| r.clone()).collect();
        assert!(tokens.len() > 2 * PIECE && !tokens.len().is_multiple_of(PIECE));
        // Query j sees every token, the first 1,000 or none, by j % 3.
        let sees = |t: usize, j: usize| j.is_multiple_of(3) || (j % 3 == 1 && t < 1000);
        let mut seed = 0x2545_f491_u64;
        let mut draw = || {
            seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            ((seed >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
        };
        let elems = 1500 * hk * d;
        let k: Vec<f32> = (0..elems).map(|_| draw()).collect();
        let v: Vec<f32> = (0..elems).map(|_| draw()).collect();
        let widened = |x: &[f32]| match TypedVec::from_f32(DType::Bf16, x) {
            TypedVec::Bf16(values) => values,
            _ => unreachable!("bf16 was asked for"),
        };
        let (k16, v16) = (widened(&k), widened(&v));
        for nq in [3, 8] {
            let rows = nq * shape.group_size();
            assert_eq!(rows >= GEMM_ROWS, nq == 8, "both paths are taken");
            let q: Vec<f32> = (0..nq * h * d).map(|_| draw()).collect();
            let mask = (0..tokens.len())
                .map(|t| (0..nq).filter(|&j| sees(t, j)).map(|j| 1u64 << j).sum())
                .collect();
            let group = Group {
                kv: kv.clone(),
                queries: (0..nq as u32).rev().collect(),
                mask: Some(mask),
            };
            let check = |o: &[f32], lse: &[f32], kv_f64: &dyn Fn(bool, usize) -> f64| {
                for j in 0..nq {
                    for head in 0..h {
                        let qv = &q[(group.queries[j] as usize * h + head) * d..][..d];
                        let row = |t: u32| (t as usize * hk + head / shape.group_size()) * d;
                        let scores: Vec<(u32, f64)> = (tokens.iter().enumerate())
                            .filter(|&(ti, _)| sees(ti, j))
                            .map(|(_, &t)| {
                                let dot: f64 = (0..d)
                                    .map(|c| qv[c] as f64 * kv_f64(true, row(t) + c))
                                    .sum();
                                (t, dot * shape.softmax_scale() as f64)
                            })
                            .collect();
                        let (o, lse) = (&o[(j * h + head) * d..][..d], lse[j * h + head]);
                        if scores.is_empty() {
                            assert!(lse == EMPTY_LSE && o.iter().all(|&x| x == 0.0));
                            continue;
                        }
                        let m = scores.iter().map(|s| s.1).fold(f64::NEG_INFINITY, f64::max);
                        let total: f64 = scores.iter().map(|s| (s.1 - m).exp()).sum();
                        let lse_error = (lse as f64 - (m + total.ln())).abs();
                        assert!(lse_error < 1e-4, "{nq} queries: lse {j} {head}");
                        for (c, &got) in o.iter().enumerate() {
                            let want: f64 = (scores.iter())
                                .map(|&(t, s)| (s - m).exp() / total * kv_f64(false, row(t) + c))
                                .sum();
                            assert!((got as f64 - want).abs() < 1e-5, "{nq}: o {j} {head} {c}");
                        }
                    }
                }
            };
            let (mut o, mut lse) = (vec![f32::NAN; nq * h * d], vec![f32::NAN; nq * h]);
            group_partial(&shape, &group, &q, &k, &v, &mut o, &mut lse);
            check(&o, &lse, &|key, i| if key { k[i] } else { v[i] } as f64);
            let (mut o, mut lse) = (vec![f32::NAN; nq * h * d], vec![f32::NAN; nq * h]);
            group_partial(&shape, &group, &q, &k16, &v16, &mut o, &mut lse);
            let from_bf16 = |key: bool, i: usize| if key { k16[i] } else { v16[i] }.to_f32();
            check(&o, &lse, &|key, i| from_bf16(key, i) as f64);
        }
    }
}
