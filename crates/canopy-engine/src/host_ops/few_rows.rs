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
//!
//! A quantized model's weights, kept as codes ([`canopy_core::coded`]), take this path from
//! one row on: their values are decoded eight at a time, so a product reads a third of f32's
//! bytes, and its results are those of the same product over the f32 values.

use canopy_core::{coded_value, CodedMatrix};
use rayon::prelude::*;

/// Products of two rows up to this many take this path. Larger ones (a prompt's) go to
/// `gemm`, whose packing then pays for itself (at 48-64 rows the two ran about even). One
/// row goes to `gemm`'s one-row kernel, which packs nothing and was about 3% faster over a
/// SmolLM2 decode step.
pub(super) const FEW_ROWS: usize = 32;
/// Accumulator lanes: one AVX2 register of f32.
pub(super) const LANES: usize = 8;
/// Accumulators an element: consecutive eights of `k` go to each in turn.
const CHAINS: usize = 4;
/// Input rows a weight row meets at once: 12 accumulators, a weight vector and an input
/// vector, within AVX2's 16 registers.
const TILE_ROWS: usize = 3;
/// Output columns a task takes at least.
const MIN_COLUMNS_A_TASK: usize = 64;
/// Tasks a thread gets, so that threads that finish early take more.
const TASKS_A_THREAD: usize = 8;

/// Weight rows as a product reads them, `k` values each.
pub(super) trait WeightRows: Sync {
    /// One row.
    type Row<'a>: RowEights
    where
        Self: 'a;
    /// Values in a row.
    fn k(&self) -> usize;
    /// Rows held.
    fn n(&self) -> usize;
    /// Row `column`.
    fn row(&self, column: usize) -> Self::Row<'_>;
}

/// A weight row's values as a tile reads them: eight at a time, then those past its last
/// whole eight.
pub(super) trait RowEights: Copy {
    /// Whether its values are computed as they are read, rather than read.
    const DECODES: bool;
    /// Values `8 e..8 e + 8`.
    fn eight(&self, e: usize) -> [f32; LANES];
    /// The same in an AVX2 register.
    ///
    /// # Safety
    /// The CPU has AVX2.
    #[cfg(target_arch = "x86_64")]
    unsafe fn eight_avx2(&self, e: usize) -> std::arch::x86_64::__m256;
    /// Values `8 e..8 e + 32`, one eight for each chain, in AVX2 registers.
    ///
    /// # Safety
    /// The CPU has AVX2.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn chains_avx2(&self, e: usize) -> [std::arch::x86_64::__m256; CHAINS] {
        // Written out rather than by `array::from_fn`, whose closure would not be compiled
        // for AVX2.
        const { assert!(CHAINS == 4) };
        unsafe {
            [
                self.eight_avx2(e),
                self.eight_avx2(e + 1),
                self.eight_avx2(e + 2),
                self.eight_avx2(e + 3),
            ]
        }
    }
    /// Values past the last whole eight.
    fn tail(&self) -> &[f32];
}

/// f32 rows of `k` values.
pub(super) struct DenseRows<'a> {
    pub w: &'a [f32],
    pub k: usize,
}

impl WeightRows for DenseRows<'_> {
    type Row<'a>
        = Values<'a>
    where
        Self: 'a;

    fn k(&self) -> usize {
        self.k
    }

    fn n(&self) -> usize {
        self.w.len() / self.k.max(1)
    }

    #[inline(always)]
    fn row(&self, column: usize) -> Values<'_> {
        Values(&self.w[column * self.k..(column + 1) * self.k])
    }
}

/// A row of f32 values, read in place.
#[derive(Clone, Copy)]
pub(super) struct Values<'a>(&'a [f32]);

impl RowEights for Values<'_> {
    const DECODES: bool = false;

    #[inline(always)]
    fn eight(&self, e: usize) -> [f32; LANES] {
        std::array::from_fn(|l| self.0[e * LANES + l])
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn eight_avx2(&self, e: usize) -> std::arch::x86_64::__m256 {
        debug_assert!((e + 1) * LANES <= self.0.len());
        std::arch::x86_64::_mm256_loadu_ps(self.0.as_ptr().add(e * LANES))
    }

    fn tail(&self) -> &[f32] {
        &self.0[self.0.len() / LANES * LANES..]
    }
}

/// A quantized model's rows, in groups of a power of two of at least [`LANES`] elements
/// (checked by the caller), decoded with [`coded_value`]'s arithmetic once for all the input
/// rows: as the tile reads them where one tile covers the rows, else into memory first. A
/// third of f32's bytes are read, and the values are the same.
impl WeightRows for CodedMatrix {
    type Row<'a> = Codes<'a>;

    fn k(&self) -> usize {
        self.cols
    }

    fn n(&self) -> usize {
        self.rows
    }

    #[inline(always)]
    fn row(&self, column: usize) -> Codes<'_> {
        let (k, group) = (self.cols, self.group);
        let groups = column * k / group..(column + 1) * k / group;
        Codes {
            codes: &self.codes[column * k..(column + 1) * k],
            steps: &self.steps[groups.clone()],
            offsets: &self.offsets[groups],
            shift: group.trailing_zeros(),
        }
    }
}

/// One coded row: its codes, and its groups' steps and offsets, `2^shift` elements a group.
#[derive(Clone, Copy)]
pub(super) struct Codes<'a> {
    codes: &'a [i8],
    steps: &'a [f32],
    offsets: &'a [f32],
    shift: u32,
}

impl RowEights for Codes<'_> {
    const DECODES: bool = true;

    #[inline(always)]
    fn eight(&self, e: usize) -> [f32; LANES] {
        let g = (e * LANES) >> self.shift;
        std::array::from_fn(|l| {
            coded_value(self.codes[e * LANES + l], self.steps[g], self.offsets[g])
        })
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn eight_avx2(&self, e: usize) -> std::arch::x86_64::__m256 {
        let (step, offset) = self.group_avx2((e * LANES) >> self.shift);
        self.decode_avx2(e, step, offset)
    }

    /// Where a group holds every chain's eight (groups of 32 or more, as most types have),
    /// its step and offset are read once for the four.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn chains_avx2(&self, e: usize) -> [std::arch::x86_64::__m256; CHAINS] {
        if self.shift as usize >= (CHAINS * LANES).trailing_zeros() as usize {
            let (step, offset) = self.group_avx2((e * LANES) >> self.shift);
            const { assert!(CHAINS == 4) };
            [
                self.decode_avx2(e, step, offset),
                self.decode_avx2(e + 1, step, offset),
                self.decode_avx2(e + 2, step, offset),
                self.decode_avx2(e + 3, step, offset),
            ]
        } else {
            [
                self.eight_avx2(e),
                self.eight_avx2(e + 1),
                self.eight_avx2(e + 2),
                self.eight_avx2(e + 3),
            ]
        }
    }

    fn tail(&self) -> &[f32] {
        &[]
    }
}

#[cfg(target_arch = "x86_64")]
impl Codes<'_> {
    /// Group `g`'s step and offset, in every lane.
    #[inline(always)]
    unsafe fn group_avx2(
        &self,
        g: usize,
    ) -> (std::arch::x86_64::__m256, std::arch::x86_64::__m256) {
        use std::arch::x86_64::_mm256_broadcast_ss;
        debug_assert!(g < self.steps.len());
        unsafe {
            (
                _mm256_broadcast_ss(&*self.steps.as_ptr().add(g)),
                _mm256_broadcast_ss(&*self.offsets.as_ptr().add(g)),
            )
        }
    }

    /// Codes `8 e..8 e + 8` widened to i32 and converted, then multiplied by `step` and added
    /// to `offset` in two roundings, as [`coded_value`] computes them.
    #[inline(always)]
    unsafe fn decode_avx2(
        &self,
        e: usize,
        step: std::arch::x86_64::__m256,
        offset: std::arch::x86_64::__m256,
    ) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        debug_assert!((e + 1) * LANES <= self.codes.len());
        unsafe {
            let codes = _mm_loadl_epi64(self.codes.as_ptr().add(e * LANES) as *const __m128i);
            let values = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes));
            _mm256_add_ps(_mm256_mul_ps(values, step), offset)
        }
    }
}

/// `out[rows × n] = x[rows × k] · w[n × k]ᵀ`, or `out +=` it when `accumulate`, over the
/// current rayon pool.
pub(super) fn matmul<W: WeightRows>(
    x: &[f32],
    rows: usize,
    w: &W,
    out: &mut [f32],
    accumulate: bool,
) {
    let (k, n) = (w.k(), w.n());
    assert!(x.len() == rows * k && out.len() == rows * n);
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
    let out = OutPtr(out.as_mut_ptr());
    (0..n.div_ceil(per_task)).into_par_iter().for_each(|task| {
        let first = task * per_task;
        let columns = first..(first + per_task).min(n);
        // SAFETY: tasks write disjoint column ranges of `out`, which outlives them, and
        // nothing else reads or writes it meanwhile.
        unsafe { product.columns(columns, out) }
    });
}

/// The operands of one product.
struct Product<'a, W> {
    x: &'a [f32],
    rows: usize,
    k: usize,
    w: &'a W,
    n: usize,
    accumulate: bool,
}

/// `out`'s start, shared by the tasks that write its columns.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: each task writes only its own columns (see `matmul`).
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl<W: WeightRows> Product<'_, W> {
    /// Writes `columns` of every row of `out`.
    ///
    /// # Safety
    /// `out` holds `rows × n` elements, and no other thread touches these columns.
    unsafe fn columns(&self, columns: std::ops::Range<usize>, out: OutPtr) {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            return avx2::columns(self, columns, out);
        }
        self.walk::<Portable>(columns, out)
    }

    /// Covers `columns` × all rows, [`TILE_ROWS`] rows of a column at a time.
    /// A row that decodes is decoded as the tile reads it where one tile covers the rows;
    /// where several do, it is decoded once into memory that each tile then reads.
    #[inline(always)]
    unsafe fn walk<T: Tiles>(&self, columns: std::ops::Range<usize>, out: OutPtr) {
        let decode_once = <W::Row<'_> as RowEights>::DECODES && self.rows > TILE_ROWS;
        let mut decoded = vec![0.0; if decode_once { self.k } else { 0 }];
        for column in columns {
            let w = self.w.row(column);
            if decode_once {
                T::decode(w, &mut decoded);
                self.tiles::<T>(column, Values(&decoded), out);
            } else {
                self.tiles::<T>(column, w, out);
            }
        }
    }

    /// Every row of one column, [`TILE_ROWS`] at a time, whose weight row is `w`.
    #[inline(always)]
    unsafe fn tiles<T: Tiles>(&self, column: usize, w: impl RowEights, out: OutPtr) {
        let mut row = 0;
        while self.rows - row >= TILE_ROWS {
            self.tile::<T, TILE_ROWS>(row, (column, w), out);
            row += TILE_ROWS;
        }
        match self.rows - row {
            2 => self.tile::<T, 2>(row, (column, w), out),
            1 => self.tile::<T, 1>(row, (column, w), out),
            _ => {}
        }
    }

    /// Rows `row..row + R` of one column, whose weight row is `w`.
    #[inline(always)]
    unsafe fn tile<T: Tiles, const R: usize>(
        &self,
        row: usize,
        (column, w): (usize, impl RowEights),
        out: OutPtr,
    ) {
        let k = self.k;
        let x = &self.x[row * k..(row + R) * k];
        let chains = T::chains::<R>(x, k, w);
        let tail = w.tail();
        let whole = k - tail.len();
        for (r, chains) in chains.iter().enumerate() {
            let mut sum = sum_chains(chains);
            for (i, &w) in tail.iter().enumerate() {
                sum = x[r * k + whole + i].mul_add(w, sum);
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

/// One weight row's accumulators with `R` input rows (each `k` long) over the whole eights
/// of `k`: `chains[r][j][l]` is the fused multiply-add, in order, of `x[r][i] · w[i]` over the
/// `i` with `(i / 8) mod 4 = j` and `i mod 8 = l`.
trait Tiles {
    unsafe fn chains<const R: usize>(
        x: &[f32],
        k: usize,
        w: impl RowEights,
    ) -> [[[f32; LANES]; CHAINS]; R];
    /// `w`'s whole eights into `out`.
    unsafe fn decode(w: impl RowEights, out: &mut [f32]);
}

/// Any CPU: the lanes as arrays.
struct Portable;

impl Tiles for Portable {
    #[inline(always)]
    unsafe fn chains<const R: usize>(
        x: &[f32],
        k: usize,
        w: impl RowEights,
    ) -> [[[f32; LANES]; CHAINS]; R] {
        let mut acc = [[[0.0f32; LANES]; CHAINS]; R];
        for eight in 0..k / LANES {
            let ws = w.eight(eight);
            let start = eight * LANES;
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

    #[inline(always)]
    unsafe fn decode(w: impl RowEights, out: &mut [f32]) {
        for (e, values) in out.chunks_exact_mut(LANES).enumerate() {
            values.copy_from_slice(&w.eight(e));
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{OutPtr, Product, RowEights, Tiles, WeightRows, CHAINS, LANES};
    use std::arch::x86_64::*;

    /// [`Product::columns`] compiled for AVX2 and FMA.
    ///
    /// # Safety
    /// As [`Product::columns`]; the CPU has AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn columns<W: WeightRows>(
        product: &Product<W>,
        columns: std::ops::Range<usize>,
        out: OutPtr,
    ) {
        product.walk::<Avx2>(columns, out)
    }

    /// The lanes in AVX2 registers.
    struct Avx2;

    impl Tiles for Avx2 {
        #[inline(always)]
        unsafe fn chains<const R: usize>(
            x: &[f32],
            k: usize,
            w: impl RowEights,
        ) -> [[[f32; LANES]; CHAINS]; R] {
            let mut acc = [[_mm256_setzero_ps(); CHAINS]; R];
            let eights = k / LANES;
            let step = |eight: usize, chain: usize, ws: __m256, acc: &mut [[__m256; CHAINS]; R]| {
                for (r, acc) in acc.iter_mut().enumerate() {
                    let xs = _mm256_loadu_ps(x.as_ptr().add(r * k + eight * LANES));
                    acc[chain] = _mm256_fmadd_ps(xs, ws, acc[chain]);
                }
            };
            let mut eight = 0;
            while eight + CHAINS <= eights {
                let ws = w.chains_avx2(eight);
                for (chain, &ws) in ws.iter().enumerate() {
                    step(eight + chain, chain, ws, &mut acc);
                }
                eight += CHAINS;
            }
            for chain in 0..eights - eight {
                step(eight + chain, chain, w.eight_avx2(eight + chain), &mut acc);
            }
            let mut chains = [[[0.0f32; LANES]; CHAINS]; R];
            for (out, acc) in chains.iter_mut().zip(&acc) {
                for (o, a) in out.iter_mut().zip(acc) {
                    _mm256_storeu_ps(o.as_mut_ptr(), *a);
                }
            }
            chains
        }

        #[inline(always)]
        unsafe fn decode(w: impl RowEights, out: &mut [f32]) {
            for e in 0..out.len() / LANES {
                _mm256_storeu_ps(out.as_mut_ptr().add(e * LANES), w.eight_avx2(e));
            }
        }
    }
}
#[cfg(test)]
mod tests {
    use super::*;

    fn rows_of(w: &[f32], k: usize) -> DenseRows<'_> {
        DenseRows { w, k }
    }

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
                    pool.install(|| matmul(&x, FEW_ROWS, &rows_of(&w, k), &mut batch, accumulate));
                    for r in [0, 1, FEW_ROWS - 1] {
                        let mut alone = start[r * n..(r + 1) * n].to_vec();
                        matmul(
                            &x[r * k..(r + 1) * k],
                            1,
                            &rows_of(&w, k),
                            &mut alone,
                            accumulate,
                        );
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
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            let (rows, k, n) = (5, 203, 37);
            let x: Vec<f32> = (0..rows * k).map(|i| value(i, 2.0)).collect();
            let w: Vec<f32> = (0..n * k).map(|i| value(i + 5, 0.3)).collect();
            let product = Product {
                x: &x,
                rows,
                k,
                w: &rows_of(&w, k),
                n,
                accumulate: false,
            };
            let mut fast = vec![f32::NAN; rows * n];
            let mut portable = vec![f32::NAN; rows * n];
            // SAFETY: each output holds rows × n elements; one thread writes it.
            unsafe {
                avx2::columns(&product, 0..n, OutPtr(fast.as_mut_ptr()));
                product.walk::<Portable>(0..n, OutPtr(portable.as_mut_ptr()));
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
