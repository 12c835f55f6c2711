//! What every blocked attention on the host shares: a block's scores as one product, and the
//! online softmax that folds a block into its rows' running maximum, sum and weighted values.
//! Many rows take both products on `gemm`; a few rows (one sequence's GQA heads at a decode
//! step) take dot products and row additions, which cost less than a `gemm` call there.
//!
//! The loops here sum in [`LANES`] partial sums added in a fixed order, with fused
//! multiply-adds, and run compiled for AVX2 and FMA where the CPU has them ([`with_fma`]): one
//! source, so the same bits on every machine, in 8-wide vectors where it can. On AVX2 the
//! few-row scores take the module `avx2`'s form, which adds in the same order. The softmax's
//! exponentials are `rten-vecmath`'s, vectorized for the CPU's widest instructions; each
//! element's is computed alone, so the vector width does not change it.

#[cfg(target_arch = "x86_64")]
mod avx2;

#[cfg(target_arch = "x86_64")]
use super::has_avx2_and_fma;
use canopy_core::EMPTY_LSE;
use rten_simd::SimdUnaryOp;
use rten_vecmath::Exp;

/// Rows of `d` f32 values `stride` apart in `data`, row 0 at its start.
#[derive(Clone, Copy)]
pub struct Rows<'a> {
    pub data: &'a [f32],
    pub stride: usize,
}

impl<'a> Rows<'a> {
    /// The rows of `data` from element `first` on, `stride` apart.
    pub fn at(data: &'a [f32], first: usize, stride: usize) -> Self {
        Rows {
            data: &data[first..],
            stride,
        }
    }

    /// Row `i`'s `d` values.
    #[inline(always)]
    fn row(&self, i: usize, d: usize) -> &'a [f32] {
        &self.data[i * self.stride..][..d]
    }

    /// Whether `rows` rows of `d` values lie inside `data`, as a `gemm` call over them needs.
    fn holds(&self, rows: usize, d: usize) -> bool {
        rows == 0 || (rows - 1) * self.stride + d <= self.data.len()
    }
}

/// How a block's two products are computed.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Products {
    /// `gemm`, on one thread: for many rows.
    Gemm,
    /// Dot products and row additions: for a few rows.
    Loops,
}

/// `scores[rows × keys] = scale · q · kᵀ`, each of `q`'s and `k`'s rows `d` long.
pub fn scores(
    q: Rows,
    k: Rows,
    (rows, keys, d): (usize, usize, usize),
    scale: f32,
    by: Products,
    scores: &mut [f32],
) {
    assert!(q.holds(rows, d) && k.holds(keys, d) && scores.len() >= rows * keys);
    match by {
        // SAFETY: the assertion above keeps every row the product reads or writes inside its
        // slice.
        Products::Gemm => unsafe {
            gemm::gemm(
                rows,
                keys,
                d,
                scores.as_mut_ptr(),
                1,
                keys as isize,
                false,
                q.data.as_ptr(),
                1,
                q.stride as isize,
                k.data.as_ptr(),
                k.stride as isize,
                1,
                0.0,
                scale,
                false,
                false,
                false,
                gemm::Parallelism::None,
            );
        },
        Products::Loops => {
            #[cfg(target_arch = "x86_64")]
            if d % LANES == 0 && has_avx2_and_fma() {
                // SAFETY: the CPU has AVX2 and FMA, and the assertion above holds.
                return unsafe { avx2::scores(q, k, (rows, keys, d), scale, scores) };
            }
            with_fma(
                #[inline(always)]
                || scores_by_loops(q, k, (rows, keys, d), scale, scores),
            )
        }
    }
}

/// [`scores`] by dot products, each key's row read once for every query row.
#[inline(always)]
fn scores_by_loops(
    q: Rows,
    k: Rows,
    (rows, keys, d): (usize, usize, usize),
    scale: f32,
    scores: &mut [f32],
) {
    for t in 0..keys {
        let key = k.row(t, d);
        for r in 0..rows {
            scores[r * keys + t] = dot(q.row(r, d), key) * scale;
        }
    }
}

/// Partial sums a loop keeps: it adds into these lanes, then adds them in a fixed order
/// ([`sum_lanes`]), the same on every machine.
const LANES: usize = 8;

/// Runs `body` compiled for AVX2 and FMA where this CPU has them, else as built. The source is
/// one, so the results are the same bits; the body's callees must be inlined into it
/// (`#[inline(always)]`) to be compiled for the wider instructions.
#[inline(always)]
fn with_fma<R>(body: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_and_fma() {
        #[target_feature(enable = "avx2,fma")]
        unsafe fn vectorized<R>(body: impl FnOnce() -> R) -> R {
            body()
        }
        // SAFETY: this CPU has AVX2 and FMA, checked above.
        return unsafe { vectorized(body) };
    }
    body()
}

/// The lanes' total, added in order. (Added as a tree, the lanes' sums became pairs of
/// 2-wide vectors in LLVM's hands, not one 8-wide vector.)
#[inline(always)]
fn sum_lanes(lanes: [f32; LANES]) -> f32 {
    lanes.iter().sum()
}

/// `a · b` in [`LANES`] partial sums of fused multiply-adds; a sum in order is one dependent
/// chain of scalar adds.
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let ((a8, a_tail), (b8, b_tail)) = (a.as_chunks::<LANES>(), b.as_chunks::<LANES>());
    let tail = (a_tail.iter().zip(b_tail)).fold(0.0f32, |s, (x, y)| x.mul_add(*y, s));
    let mut lanes = [0.0f32; LANES];
    for (x, y) in a8.iter().zip(b8) {
        for l in 0..LANES {
            lanes[l] = x[l].mul_add(y[l], lanes[l]);
        }
    }
    sum_lanes(lanes) + tail
}

/// The largest of `xs` and `start`; a maximum is the same in any order.
#[inline(always)]
fn max_of(xs: &[f32], start: f32) -> f32 {
    let (chunks, tail) = xs.as_chunks::<LANES>();
    let mut lanes = [start; LANES];
    for x in chunks {
        for l in 0..LANES {
            lanes[l] = lanes[l].max(x[l]);
        }
    }
    (lanes.iter().chain(tail)).fold(start, |m, &x| m.max(x))
}

/// The total of `xs` in [`LANES`] partial sums.
#[inline(always)]
fn total(xs: &[f32]) -> f32 {
    let (chunks, tail) = xs.as_chunks::<LANES>();
    let mut lanes = [0.0f32; LANES];
    for x in chunks {
        for l in 0..LANES {
            lanes[l] += x[l];
        }
    }
    sum_lanes(lanes) + tail.iter().sum::<f32>()
}

/// `out += Σ weights[t] · v[t]` over the block's keys, each element's terms added in key order.
/// Each 64 columns of `out` are held in registers across the keys, not loaded and stored a key
/// at a time. A key of weight zero (one the row does not see) is skipped.
#[inline(always)]
fn add_weighted(out: &mut [f32], weights: &[f32], v: Rows) {
    const COLUMNS: usize = 8 * LANES;
    for (c, out) in out.chunks_mut(COLUMNS).enumerate() {
        let (at, width) = (c * COLUMNS, out.len());
        let value = |t: usize| &v.data[t * v.stride + at..][..width];
        if let Ok(out) = <&mut [f32; COLUMNS]>::try_from(&mut *out) {
            let mut sums = *out;
            for (t, &p) in weights.iter().enumerate() {
                if p != 0.0 {
                    let x: &[f32; COLUMNS] = value(t).try_into().expect("a whole slice");
                    for i in 0..COLUMNS {
                        sums[i] = p.mul_add(x[i], sums[i]);
                    }
                }
            }
            *out = sums;
        } else {
            for (t, &p) in weights.iter().enumerate() {
                if p != 0.0 {
                    for (o, &x) in out.iter_mut().zip(value(t)) {
                        *o = p.mul_add(x, *o);
                    }
                }
            }
        }
    }
}

/// Rows' softmax over keys that arrive in blocks: each row's running maximum and sum, and its
/// values weighted by exponentials relative to that maximum.
pub struct OnlineSoftmax {
    d: usize,
    max: Vec<f32>,
    sum: Vec<f32>,
    out: Vec<f32>,
    /// Each row's factor from its maximum before a block to its maximum after.
    rescale: Vec<f32>,
}

impl OnlineSoftmax {
    pub fn new(rows: usize, d: usize) -> Self {
        OnlineSoftmax {
            d,
            max: vec![f32::NEG_INFINITY; rows],
            sum: vec![0.0; rows],
            out: vec![0.0; rows * d],
            rescale: vec![1.0; rows],
        }
    }

    /// Folds in one block of `keys` keys: `scores` (`rows × keys`, a key a row does not see
    /// at `-inf`) become the block's weights, each row's values so far are rescaled to its
    /// new maximum, and the block's values `v` (`keys` rows), weighted, are added.
    pub fn absorb(&mut self, scores: &mut [f32], keys: usize, v: Rows, by: Products) {
        let (rows, d) = (self.max.len(), self.d);
        assert!(v.holds(keys, d) && scores.len() >= rows * keys);
        let scores = &mut scores[..rows * keys];
        with_fma(
            #[inline(always)]
            || {
                for (r, row) in scores.chunks_mut(keys).enumerate() {
                    let new_max = max_of(row, self.max[r]);
                    if new_max == f32::NEG_INFINITY {
                        // The row sees none of these keys, nor any before: its weights are
                        // the exponentials of -inf, zeros.
                        self.rescale[r] = 1.0;
                        continue;
                    }
                    self.rescale[r] = (self.max[r] - new_max).exp();
                    self.max[r] = new_max;
                    row.iter_mut().for_each(|s| *s -= new_max);
                }
            },
        );
        // A score of -inf (a key the row does not see) gives 0.
        Exp {}.map_mut(scores);
        with_fma(
            #[inline(always)]
            || {
                for (r, row) in scores.chunks(keys).enumerate() {
                    let rescale = self.rescale[r];
                    self.sum[r] = self.sum[r] * rescale + total(row);
                    if rescale != 1.0 {
                        self.out[r * d..(r + 1) * d]
                            .iter_mut()
                            .for_each(|o| *o *= rescale);
                    }
                }
            },
        );
        match by {
            // SAFETY: the assertion above keeps every row the product reads inside its slice;
            // `out` is rows × d.
            Products::Gemm => unsafe {
                gemm::gemm(
                    rows,
                    d,
                    keys,
                    self.out.as_mut_ptr(),
                    1,
                    d as isize,
                    true,
                    scores.as_ptr(),
                    1,
                    keys as isize,
                    v.data.as_ptr(),
                    1,
                    v.stride as isize,
                    1.0,
                    1.0,
                    false,
                    false,
                    false,
                    gemm::Parallelism::None,
                );
            },
            Products::Loops => with_fma(
                #[inline(always)]
                || {
                    for (out, weights) in self.out.chunks_mut(d).zip(scores.chunks(keys)) {
                        add_weighted(out, weights, v);
                    }
                },
            ),
        }
    }

    /// The rows' normalised values (`rows × d`) and natural-log sums ([`EMPTY_LSE`], with
    /// zero values, for a row that saw no key).
    pub fn finish(mut self) -> (Vec<f32>, Vec<f32>) {
        let lse = (self.max.iter().zip(&self.sum))
            .map(|(&m, &s)| if s > 0.0 { m + s.ln() } else { EMPTY_LSE })
            .collect();
        for (row, &s) in self.out.chunks_mut(self.d).zip(&self.sum) {
            if s > 0.0 {
                row.iter_mut().for_each(|o| *o /= s);
            }
        }
        (self.out, lse)
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

    /// The loops give the same bits compiled for AVX2 and FMA as compiled for the baseline
    /// CPU (where `mul_add` is the C library's `fmaf`, also fused): dot products, maxima and
    /// totals at lengths around the lanes, and weighted rows of 64 columns and of a tail.
    #[test]
    fn the_loops_give_the_same_bits_on_every_cpu() {
        let val = |i: usize| ((i * 7919 % 1009) as f32 / 1009.0 - 0.5) * 3.0;
        for len in 0..41 {
            let a: Vec<f32> = (0..len).map(val).collect();
            let b: Vec<f32> = (0..len).map(|i| val(i + 500)).collect();
            let same = |x: f32, y: f32| x.to_bits() == y.to_bits();
            assert!(
                same(with_fma(|| dot(&a, &b)), dot(&a, &b)),
                "dot, length {len}"
            );
            assert!(
                same(with_fma(|| total(&a)), total(&a)),
                "total, length {len}"
            );
            let start = if len % 2 == 0 { f32::NEG_INFINITY } else { 0.7 };
            assert!(same(with_fma(|| max_of(&a, start)), max_of(&a, start)));
            let want = a.iter().fold(start, |m, &x| m.max(x));
            assert_eq!(max_of(&a, start), want, "max, length {len}");
        }
        for d in [64, 80, 128] {
            let keys = 13;
            let v: Vec<f32> = (0..keys * (d + 3)).map(|i| val(i + 7)).collect();
            let weights: Vec<f32> = (0..keys)
                .map(|t| if t % 4 == 1 { 0.0 } else { val(t + 99) })
                .collect();
            let v = Rows {
                data: &v,
                stride: d + 3,
            };
            let start: Vec<f32> = (0..d).map(|i| val(i + 3)).collect();
            let (mut fast, mut portable) = (start.clone(), start.clone());
            with_fma(|| add_weighted(&mut fast, &weights, v));
            add_weighted(&mut portable, &weights, v);
            assert!(fast
                .iter()
                .zip(&portable)
                .all(|(x, y)| x.to_bits() == y.to_bits()));
            for (i, &got) in portable.iter().enumerate() {
                let want: f64 = (0..keys)
                    .map(|t| weights[t] as f64 * v.data[t * v.stride + i] as f64)
                    .sum::<f64>()
                    + start[i] as f64;
                assert!((got as f64 - want).abs() < 1e-5, "head dim {d} [{i}]");
            }
        }
    }

    /// Where the CPU has AVX2 and FMA, its few-row scores are the portable loops' bits, for
    /// key counts with and without a remainder past the last eight and head dims of 64 and 128.
    #[test]
    fn the_avx2_scores_equal_the_loops() {
        #[cfg(target_arch = "x86_64")]
        if has_avx2_and_fma() {
            let val = |i: usize| ((i * 7919 % 1009) as f32 / 1009.0 - 0.5) * 3.0;
            for (rows, keys, d) in [
                (1, 8, 64),
                (3, 13, 64),
                (3, 64, 64),
                (7, 3, 128),
                (5, 41, 128),
            ] {
                let q: Vec<f32> = (0..rows * (d + 8)).map(val).collect();
                let k: Vec<f32> = (0..keys * (d + 16)).map(|i| val(i + 31)).collect();
                let (q, k) = (
                    Rows {
                        data: &q,
                        stride: d + 8,
                    },
                    Rows {
                        data: &k,
                        stride: d + 16,
                    },
                );
                let (mut fast, mut loops) =
                    (vec![f32::NAN; rows * keys], vec![f32::NAN; rows * keys]);
                // SAFETY: the CPU has AVX2 and FMA; the rows and scores fit their slices.
                unsafe { avx2::scores(q, k, (rows, keys, d), 0.125, &mut fast) };
                scores_by_loops(q, k, (rows, keys, d), 0.125, &mut loops);
                let same = fast
                    .iter()
                    .zip(&loops)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{rows} rows × {keys} keys at head dim {d}");
            }
            return;
        }
        eprintln!("no AVX2 and FMA here: only the portable loops run");
    }

    /// Both ways of taking the products give the same softmax, within rounding, over blocks
    /// whose keys some rows do not see.
    #[test]
    fn gemm_and_loops_agree() {
        let (rows, keys, d) = (5, 9, 64);
        let val = |i: usize| (((i * 7919) % 1009) as f32 / 1009.0 - 0.5) * 3.0;
        let q: Vec<f32> = (0..rows * d).map(|i| val(i + 3)).collect();
        let k: Vec<f32> = (0..2 * keys * d).map(|i| val(3 * i + 1)).collect();
        let v: Vec<f32> = (0..2 * keys * d).map(|i| val(5 * i + 2)).collect();
        let run = |by: Products| {
            let mut state = OnlineSoftmax::new(rows, d);
            for block in 0..2 {
                let at = block * keys * d;
                let (k, v) = (&k[at..], &v[at..]);
                let mut s = vec![0.0; rows * keys];
                let q = Rows {
                    data: &q,
                    stride: d,
                };
                scores(
                    q,
                    Rows { data: k, stride: d },
                    (rows, keys, d),
                    0.125,
                    by,
                    &mut s,
                );
                // Row 0 sees nothing of block 0; row 1 nothing at all.
                for (r, row) in s.chunks_mut(keys).enumerate() {
                    if r == 1 || (r == 0 && block == 0) {
                        row.fill(f32::NEG_INFINITY);
                    }
                }
                state.absorb(&mut s, keys, Rows { data: v, stride: d }, by);
            }
            state.finish()
        };
        let ((o_gemm, lse_gemm), (o_loops, lse_loops)) =
            (run(Products::Gemm), run(Products::Loops));
        assert_eq!(lse_gemm[1], EMPTY_LSE);
        assert!(o_gemm[d..2 * d].iter().all(|&x| x == 0.0));
        for (a, b) in lse_gemm.iter().zip(&lse_loops) {
            assert!(a == b || (a - b).abs() < 1e-5, "{a} against {b}");
        }
        for (a, b) in o_gemm.iter().zip(&o_loops) {
            assert!((a - b).abs() < 1e-5, "{a} against {b}");
        }
    }
}
