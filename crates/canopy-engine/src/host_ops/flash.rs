//! What every blocked attention on the host shares: a block's scores as one product, and the
//! online softmax that folds a block into its rows' running maximum, sum and weighted values.
//! Many rows take both products on `gemm`; a few rows (one sequence's GQA heads at a decode
//! step) take dot products and row additions, which cost less than a `gemm` call there.

use canopy_core::EMPTY_LSE;

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
            for (r, out) in scores.chunks_mut(keys).take(rows).enumerate() {
                let qr = q.row(r, d);
                for (t, s) in out.iter_mut().enumerate() {
                    *s = dot(qr, k.row(t, d)) * scale;
                }
            }
        }
    }
}

/// `a · b` in eight partial sums, which the compiler keeps in vector registers; a sum in
/// order is one dependent chain of scalar adds.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
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

/// Rows' softmax over keys that arrive in blocks: each row's running maximum and sum, and its
/// values weighted by exponentials relative to that maximum.
pub struct OnlineSoftmax {
    d: usize,
    max: Vec<f32>,
    sum: Vec<f32>,
    out: Vec<f32>,
}

impl OnlineSoftmax {
    pub fn new(rows: usize, d: usize) -> Self {
        OnlineSoftmax {
            d,
            max: vec![f32::NEG_INFINITY; rows],
            sum: vec![0.0; rows],
            out: vec![0.0; rows * d],
        }
    }

    /// Folds in one block of `keys` keys: `scores` (`rows × keys`, a key a row does not see
    /// at `-inf`) become the block's weights, each row's values so far are rescaled to its
    /// new maximum, and the block's values `v` (`keys` rows), weighted, are added.
    pub fn absorb(&mut self, scores: &mut [f32], keys: usize, v: Rows, by: Products) {
        let (rows, d) = (self.max.len(), self.d);
        assert!(v.holds(keys, d) && scores.len() >= rows * keys);
        for (r, row) in scores.chunks_mut(keys).take(rows).enumerate() {
            let new_max = row.iter().fold(self.max[r], |m, &s| m.max(s));
            if new_max == f32::NEG_INFINITY {
                row.fill(0.0); // the row sees none of these keys, nor any before
                continue;
            }
            let rescale = (self.max[r] - new_max).exp();
            self.max[r] = new_max;
            let mut block_sum = 0.0f32;
            for s in row.iter_mut() {
                *s = (*s - new_max).exp();
                block_sum += *s;
            }
            self.sum[r] = self.sum[r] * rescale + block_sum;
            if rescale != 1.0 {
                self.out[r * d..(r + 1) * d]
                    .iter_mut()
                    .for_each(|o| *o *= rescale);
            }
        }
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
            Products::Loops => {
                for (out, weights) in self.out.chunks_mut(d).zip(scores.chunks(keys)) {
                    for (t, &p) in weights.iter().enumerate() {
                        if p != 0.0 {
                            for (o, &x) in out.iter_mut().zip(v.row(t, d)) {
                                *o += p * x;
                            }
                        }
                    }
                }
            }
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
