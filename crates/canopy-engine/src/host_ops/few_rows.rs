//! Products of a few rows, as a decode step has: each weight row read once for all of them.
//!
//! `gemm` packs the weight into its own layout for every product of more than one row. At a
//! few rows that copy costs more than the arithmetic: on two threads, with the weight read
//! from memory, SmolLM2's 49,152-row LM head took 18.0 ms at two rows against 6.2 at one,
//! and 7.4 ms at two rows here. Here each weight row is multiplied with [`TILE_ROWS`] input
//! rows at a time, so the weight streams from memory once, in order, and the input rows
//! stay in cache.
//!
//! Every output element takes the same sequence of operations, whatever the row count and
//! however the columns are cut: fused multiply-adds of the `i`-th products, in order of `i`,
//! into accumulator `(i / 8) mod 4`, lane `i mod 8` (four chains, so that the adds do not
//! wait on each other); the accumulators and their lanes summed in one fixed tree; then the
//! tail past the last whole eight. A row's result is therefore the same bits alone or in a
//! batch, and the AVX2 path equals the portable one.

use super::SharedOut;
use rayon::prelude::*;

/// Products of two rows up to this many take this path. Larger ones (a prompt's) go to
/// `gemm`, whose packing then pays for itself (at 48-64 rows the two ran about even). One
/// row goes to `gemm`'s one-row kernel, which packs nothing and was about 3% faster over a
/// SmolLM2 decode step.
pub(super) const FEW_ROWS: usize = 32;
/// Accumulator lanes: one AVX2 register of f32.
const LANES: usize = 8;
/// Accumulators an element: consecutive eights of `k` go to each in turn.
const CHAINS: usize = 4;
/// Input rows a weight row meets at once: 12 accumulators, a weight vector and an input
/// vector, within AVX2's 16 registers.
const TILE_ROWS: usize = 3;
/// Output columns a task takes at least.
const MIN_COLUMNS_A_TASK: usize = 64;
/// Tasks a thread gets, so that threads that finish early take more.
const TASKS_A_THREAD: usize = 8;

/// `out[rows × n] = x[rows × k] · w[n × k]ᵀ`, or `out +=` it when `accumulate`, over the
/// current rayon pool.
pub(super) fn matmul(
    x: &[f32],
    rows: usize,
    w: &[f32],
    n: usize,
    out: &mut [f32],
    accumulate: bool,
) {
    let k = w.len() / n.max(1);
    assert!(x.len() == rows * k && w.len() == n * k && out.len() == rows * n);
    let per_task = n
        .div_ceil(rayon::current_num_threads() * TASKS_A_THREAD)
        .max(MIN_COLUMNS_A_TASK);
    let product = Product {
        x,
        rows,
        k,
        w,
        n,
        accumulate,
    };
    let out = SharedOut(out.as_mut_ptr());
    (0..n.div_ceil(per_task)).into_par_iter().for_each(|task| {
        let first = task * per_task;
        let columns = first..(first + per_task).min(n);
        // SAFETY: tasks write disjoint column ranges of `out`, which outlives them, and
        // nothing else reads or writes it meanwhile.
        unsafe { product.columns(columns, out) }
    });
}

/// The operands of one product.
struct Product<'a> {
    x: &'a [f32],
    rows: usize,
    k: usize,
    w: &'a [f32],
    n: usize,
    accumulate: bool,
}

impl Product<'_> {
    /// Writes `columns` of every row of `out`.
    ///
    /// # Safety
    /// `out` holds `rows × n` elements, and no other thread touches these columns.
    unsafe fn columns(&self, columns: std::ops::Range<usize>, out: SharedOut) {
        #[cfg(target_arch = "x86_64")]
        if super::has_avx2_and_fma() {
            return avx2::columns(self, columns, out);
        }
        self.walk::<Portable>(columns, out)
    }

    /// Covers `columns` × all rows, [`TILE_ROWS`] rows of a column at a time.
    #[inline(always)]
    unsafe fn walk<T: Tiles>(&self, columns: std::ops::Range<usize>, out: SharedOut) {
        for column in columns {
            let mut row = 0;
            while self.rows - row >= TILE_ROWS {
                self.tile::<T, TILE_ROWS>(row, column, out);
                row += TILE_ROWS;
            }
            match self.rows - row {
                2 => self.tile::<T, 2>(row, column, out),
                1 => self.tile::<T, 1>(row, column, out),
                _ => {}
            }
        }
    }

    /// Rows `row..row + R` of one column.
    #[inline(always)]
    unsafe fn tile<T: Tiles, const R: usize>(&self, row: usize, column: usize, out: SharedOut) {
        let k = self.k;
        let x = &self.x[row * k..(row + R) * k];
        let w = &self.w[column * k..(column + 1) * k];
        let chains = T::chains::<R>(x, w);
        let whole = k / LANES * LANES;
        for (r, chains) in chains.iter().enumerate() {
            let mut sum = sum_chains(chains);
            for i in whole..k {
                sum = x[r * k + i].mul_add(w[i], sum);
            }
            let at = out.0.add((row + r) * self.n + column);
            *at = if self.accumulate { *at + sum } else { sum };
        }
    }
}

/// An element's accumulators summed in one fixed tree: the chains lane by lane, then the
/// lanes.
#[inline(always)]
fn sum_chains(chains: &[[f32; LANES]; CHAINS]) -> f32 {
    let lanes = halving_sum(*chains, |a, b| std::array::from_fn(|l| a[l] + b[l]));
    halving_sum(lanes, |a, b| a + b)
}

/// `values` summed in halves: the second half added to the first until one value is left.
#[inline(always)]
fn halving_sum<T: Copy, const N: usize>(mut values: [T; N], add: impl Fn(T, T) -> T) -> T {
    const { assert!(N.is_power_of_two()) };
    let mut width = N;
    while width > 1 {
        width /= 2;
        for i in 0..width {
            values[i] = add(values[i], values[i + width]);
        }
    }
    values[0]
}

/// One weight row's accumulators with `R` input rows over the whole eights of `k`
/// (`w.len()`): `chains[r][j][l]` is the fused multiply-add, in order, of `x[r][i] · w[i]`
/// over the `i` with `(i / 8) mod 4 = j` and `i mod 8 = l`.
trait Tiles {
    unsafe fn chains<const R: usize>(x: &[f32], w: &[f32]) -> [[[f32; LANES]; CHAINS]; R];
}

/// Any CPU: the lanes as arrays.
struct Portable;

impl Tiles for Portable {
    #[inline(always)]
    unsafe fn chains<const R: usize>(x: &[f32], w: &[f32]) -> [[[f32; LANES]; CHAINS]; R] {
        let k = w.len();
        let mut acc = [[[0.0f32; LANES]; CHAINS]; R];
        for (eight, start) in (0..k / LANES * LANES).step_by(LANES).enumerate() {
            let ws = &w[start..start + LANES];
            for (r, acc) in acc.iter_mut().enumerate() {
                let xs = &x[r * k + start..r * k + start + LANES];
                let lanes = &mut acc[eight % CHAINS];
                for l in 0..LANES {
                    lanes[l] = xs[l].mul_add(ws[l], lanes[l]);
                }
            }
        }
        acc
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{Product, SharedOut, Tiles, CHAINS, LANES};
    use std::arch::x86_64::*;

    /// [`Product::columns`] compiled for AVX2 and FMA.
    ///
    /// # Safety
    /// As [`Product::columns`]; the CPU has AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn columns(
        product: &Product,
        columns: std::ops::Range<usize>,
        out: SharedOut,
    ) {
        product.walk::<Avx2>(columns, out)
    }

    /// The lanes in AVX2 registers.
    struct Avx2;

    impl Tiles for Avx2 {
        #[inline(always)]
        unsafe fn chains<const R: usize>(x: &[f32], w: &[f32]) -> [[[f32; LANES]; CHAINS]; R] {
            let k = w.len();
            let mut acc = [[_mm256_setzero_ps(); CHAINS]; R];
            let eights = k / LANES;
            let step = |eight: usize, chain: usize, acc: &mut [[__m256; CHAINS]; R]| {
                let ws = _mm256_loadu_ps(w.as_ptr().add(eight * LANES));
                for (r, acc) in acc.iter_mut().enumerate() {
                    let xs = _mm256_loadu_ps(x.as_ptr().add(r * k + eight * LANES));
                    acc[chain] = _mm256_fmadd_ps(xs, ws, acc[chain]);
                }
            };
            let mut eight = 0;
            while eight + CHAINS <= eights {
                for chain in 0..CHAINS {
                    step(eight + chain, chain, &mut acc);
                }
                eight += CHAINS;
            }
            for chain in 0..eights - eight {
                step(eight + chain, chain, &mut acc);
            }
            let mut chains = [[[0.0f32; LANES]; CHAINS]; R];
            for (out, acc) in chains.iter_mut().zip(&acc) {
                for (o, a) in out.iter_mut().zip(acc) {
                    _mm256_storeu_ps(o.as_mut_ptr(), *a);
                }
            }
            chains
        }
    }
}
#[cfg(test)]
mod tests {
    use super::*;

    fn value(i: usize, scale: f32) -> f32 {
        ((i * 7919 % 1013) as f32 / 1013.0 - 0.5) * scale
    }

    /// Each row of a product of up to [`FEW_ROWS`] rows equals that row's product alone,
    /// bit for bit, added or not, at a `k` with a tail past its eights and column counts
    /// that cut tiles and tasks unevenly, on one thread and on three.
    #[test]
    fn a_row_gives_the_same_bits_alone_or_in_a_batch() {
        let k = 301;
        for threads in [1, 3] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            for n in [1, 7, 1000, 4099] {
                let w: Vec<f32> = (0..n * k).map(|i| value(i + 17, 0.1)).collect();
                let x: Vec<f32> = (0..FEW_ROWS * k).map(|i| value(i, 2.0)).collect();
                let start: Vec<f32> = (0..FEW_ROWS * n).map(|i| value(i + 3, 1.0)).collect();
                for accumulate in [false, true] {
                    let mut batch = start.clone();
                    pool.install(|| matmul(&x, FEW_ROWS, &w, n, &mut batch, accumulate));
                    for r in [0, 1, FEW_ROWS - 1] {
                        let mut alone = start[r * n..(r + 1) * n].to_vec();
                        matmul(&x[r * k..(r + 1) * k], 1, &w, n, &mut alone, accumulate);
                        let same = alone
                            .iter()
                            .zip(&batch[r * n..])
                            .all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(
                            same,
                            "row {r}, {n} columns, {threads} threads, accumulate {accumulate}"
                        );
                    }
                }
            }
        }
    }

    /// Where the CPU has AVX2, its path gives the portable path's bits.
    #[test]
    fn the_avx2_path_equals_the_portable_one() {
        #[cfg(target_arch = "x86_64")]
        if crate::host_ops::has_avx2_and_fma() {
            let (rows, k, n) = (5, 203, 37);
            let x: Vec<f32> = (0..rows * k).map(|i| value(i, 2.0)).collect();
            let w: Vec<f32> = (0..n * k).map(|i| value(i + 5, 0.3)).collect();
            let product = Product {
                x: &x,
                rows,
                k,
                w: &w,
                n,
                accumulate: false,
            };
            let mut fast = vec![f32::NAN; rows * n];
            let mut portable = vec![f32::NAN; rows * n];
            // SAFETY: each output holds rows × n elements; one thread writes it.
            unsafe {
                avx2::columns(&product, 0..n, SharedOut(fast.as_mut_ptr()));
                product.walk::<Portable>(0..n, SharedOut(portable.as_mut_ptr()));
            }
            assert!(fast
                .iter()
                .zip(&portable)
                .all(|(a, b)| a.to_bits() == b.to_bits()));
            return;
        }
        eprintln!("no AVX2 and FMA here: only the portable path runs");
    }
}
