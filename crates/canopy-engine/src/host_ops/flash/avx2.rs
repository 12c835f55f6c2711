//! The few-row scores on AVX2 and FMA, in a form LLVM does not find from the portable loops:
//! eight keys at a time, whose eight dot products' lanes are summed through one 8 × 8
//! transpose. Each key's lanes are still added in order, as [`dot`] adds them, so the scores
//! are the portable loops' bits.

use super::{dot, Rows, LANES};
use std::arch::x86_64::*;

/// [`super::scores`] for a few rows, head dims a multiple of [`LANES`].
///
/// # Safety
/// The CPU has AVX2 and FMA; `q` holds `rows` rows and `k` `keys` rows of `d` values, `d` is
/// a multiple of [`LANES`], and `scores` holds `rows × keys`.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn scores(
    q: Rows,
    k: Rows,
    (rows, keys, d): (usize, usize, usize),
    scale: f32,
    scores: &mut [f32],
) {
    debug_assert!(d % LANES == 0 && scores.len() >= rows * keys);
    let whole = keys / LANES * LANES;
    let scale_v = _mm256_set1_ps(scale);
    for r in 0..rows {
        let query = q.row(r, d);
        for t in (0..whole).step_by(LANES) {
            // (Not `array::from_fn`: its closure is not inlined into this function.)
            let mut keys_here = [&k.data[..0]; LANES];
            for (j, key) in keys_here.iter_mut().enumerate() {
                *key = k.row(t + j, d);
            }
            let mut lanes = [_mm256_setzero_ps(); LANES];
            for c in (0..d).step_by(LANES) {
                // SAFETY: every row is `d` long and `c + LANES <= d`.
                let x = unsafe { _mm256_loadu_ps(query.as_ptr().add(c)) };
                for (lanes, key) in lanes.iter_mut().zip(&keys_here) {
                    let y = unsafe { _mm256_loadu_ps(key.as_ptr().add(c)) };
                    *lanes = _mm256_fmadd_ps(x, y, *lanes);
                }
            }
            // `dot` adds a tail of none (0.0) before the scale: a sum of -0.0 becomes 0.0.
            let sums = _mm256_add_ps(unsafe { sums_in_order(lanes) }, _mm256_setzero_ps());
            let out = &mut scores[r * keys + t..][..LANES];
            // SAFETY: `out` holds eight values.
            unsafe { _mm256_storeu_ps(out.as_mut_ptr(), _mm256_mul_ps(sums, scale_v)) };
        }
        for t in whole..keys {
            scores[r * keys + t] = dot(query, k.row(t, d)) * scale;
        }
    }
}

/// Lane `j` of the result is the total of `v[j]`'s lanes, added in order: the vectors
/// transposed, then the transposed rows added one after another.
///
/// # Safety
/// The CPU has AVX2; inlined into [`scores`], this is compiled for it.
#[inline(always)]
unsafe fn sums_in_order(v: [__m256; LANES]) -> __m256 {
    unsafe {
        // Pairs of vectors interleaved: `t[2p]` holds lanes 0, 1 (and 4, 5) of vectors 2p and
        // 2p + 1, `t[2p + 1]` lanes 2, 3 (and 6, 7).
        let mut t = [_mm256_setzero_ps(); LANES];
        for p in 0..LANES / 2 {
            t[2 * p] = _mm256_unpacklo_ps(v[2 * p], v[2 * p + 1]);
            t[2 * p + 1] = _mm256_unpackhi_ps(v[2 * p], v[2 * p + 1]);
        }
        // Then quadruples: `s[i]` holds lane `i` of vectors 0-3 in its low half (lane `i + 4`
        // in its high half), `s[4 + i]` the same of vectors 4-7.
        let mut s = [_mm256_setzero_ps(); LANES];
        for g in [0, 4] {
            s[g] = _mm256_shuffle_ps::<0x44>(t[g], t[g + 2]);
            s[g + 1] = _mm256_shuffle_ps::<0xEE>(t[g], t[g + 2]);
            s[g + 2] = _mm256_shuffle_ps::<0x44>(t[g + 1], t[g + 3]);
            s[g + 3] = _mm256_shuffle_ps::<0xEE>(t[g + 1], t[g + 3]);
        }
        // Lane `i` of all eight vectors, from the low halves for lanes 0-3 and the high for 4-7,
        // added in lane order.
        let mut sum = _mm256_permute2f128_ps::<0x20>(s[0], s[4]);
        for i in 1..4 {
            sum = _mm256_add_ps(sum, _mm256_permute2f128_ps::<0x20>(s[i], s[4 + i]));
        }
        for i in 0..4 {
            sum = _mm256_add_ps(sum, _mm256_permute2f128_ps::<0x31>(s[i], s[4 + i]));
        }
        sum
    }
}
