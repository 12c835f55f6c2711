//! A quantized weight laid out for the CPU's products, and its products of up to
//! [`FEW_ROWS`] rows: a decode step's.
//!
//! [`CodedPanels`] holds a [`CodedMatrix`] with every eight weight rows (output columns)
//! interleaved into a panel: element `i` of the panel's eight rows is eight consecutive
//! codes, and a group's eight steps (and offsets) are one vector, stored before the group's
//! codes so that a panel is read as one stream. A product decodes eight output columns'
//! weights at `i` with one load, one widening, one conversion, one multiply and one add, and
//! meets a broadcast input value in one fused multiply-add whose lanes are eight output
//! elements.
//!
//! Every output element takes the same operations, whatever the row count and however rows
//! and panels are cut: for each group of the weight, one chain of fused multiply-adds over
//! its `i` in order, from zero; the groups' sums added in order. A row's result is therefore
//! the same bits alone or in a batch, and the AVX2 path equals the portable one. A chain is
//! a group long (16 or 32), so rounding grows with the group, not with the row.
//! - Up to [`TILE_ROWS`] input rows (one sequence, or a few) decode the codes as they read
//!   them: four panels at a time for one or two rows, two for three (their accumulators,
//!   steps and offsets within AVX2's 16 registers).
//! - More rows decode a block of panels once into memory that stays in L2, and tiles of
//!   [`BLOCK_TILE_ROWS`] input rows against two panels (eight accumulators) read it.
//!
//! On this project's build host (2 cores, AVX2), a SmolLM2 step's products took about as
//! long as with row-major codes at one to three rows, and 0.6-0.8 of that time at 8 to 32.

use super::SharedOut;
use canopy_core::{coded_value, CodedMatrix};
use rayon::prelude::*;

/// Products of up to this many rows take this path; more (a prompt's) decode panels for
/// `gemm`.
pub(super) const FEW_ROWS: usize = 32;
/// Output columns a panel interleaves: one AVX2 register of f32.
pub(super) const LANES: usize = 8;
/// Input rows that decode the codes as they read them, at most.
const TILE_ROWS: usize = 3;
/// Input rows a tile over decoded panels takes.
const BLOCK_TILE_ROWS: usize = 4;
/// Decoded panels a block holds, in bytes at most: within L2 beside the input rows.
const BLOCK_BYTES: usize = 96 << 10;
/// Panels a task takes at least.
const MIN_PANELS_A_TASK: usize = 8;
/// Tasks a thread gets, so that threads that finish early take more.
const TASKS_A_THREAD: usize = 8;

/// A coded `rows × cols` weight, its rows in panels of eight, the last one padded with
/// rows of zero codes, steps and offsets.
///
/// A panel is one run of memory, a group after another: the group's eight steps, its eight
/// offsets, then its codes, `[i][lane]`. A product reads each panel as one stream.
#[derive(Debug, Clone, PartialEq)]
pub struct CodedPanels {
    pub rows: usize,
    pub cols: usize,
    group: usize,
    /// The panels, in words of four bytes: the f32 steps and offsets as their bits, and four
    /// codes a word.
    words: Vec<u32>,
}

/// Words of a group's steps and offsets.
const SCALE_WORDS: usize = 2 * LANES;

impl CodedPanels {
    /// `m` in panels. Its groups are whole within a row, as [`CodedMatrix`] keeps them; a
    /// group's codes for a panel fill whole words (eight codes an element).
    pub fn pack(m: &CodedMatrix) -> CodedPanels {
        let (rows, cols, group) = (m.rows, m.cols, m.group);
        let groups = cols / group;
        let group_words = SCALE_WORDS + group * LANES / 4;
        let mut words = vec![0u32; rows.div_ceil(LANES) * groups * group_words];
        // A panel's element `i` is its rows' elements `i`; lanes past the last row keep
        // their zeros.
        words
            .par_chunks_mut((groups * group_words).max(1))
            .enumerate()
            .for_each(|(panel, words)| {
                let lanes = panel * LANES..((panel + 1) * LANES).min(rows);
                for (g, words) in words.chunks_exact_mut(group_words).enumerate() {
                    let (scales, codes) = words.split_at_mut(SCALE_WORDS);
                    let codes = as_codes_mut(codes);
                    for (lane, row) in lanes.clone().enumerate() {
                        scales[lane] = m.steps[row * groups + g].to_bits();
                        scales[LANES + lane] = m.offsets[row * groups + g].to_bits();
                        let from = &m.codes[row * cols + g * group..][..group];
                        for (i, &code) in from.iter().enumerate() {
                            codes[i * LANES + lane] = code;
                        }
                    }
                }
            });
        CodedPanels {
            rows,
            cols,
            group,
            words,
        }
    }

    /// Elements a group of one step and offset holds.
    pub fn group(&self) -> usize {
        self.group
    }

    fn panels(&self) -> usize {
        self.rows.div_ceil(LANES)
    }

    fn groups(&self) -> usize {
        self.cols / self.group
    }

    /// Words a group takes.
    fn group_words(&self) -> usize {
        SCALE_WORDS + self.group * LANES / 4
    }

    /// Words a panel takes.
    fn panel_words(&self) -> usize {
        self.groups() * self.group_words()
    }

    /// Panel `panel`'s eight values at each `i` in turn, handed to `put(i, values)`.
    #[inline(always)]
    fn each_value(&self, panel: usize, mut put: impl FnMut(usize, [f32; LANES])) {
        let group_words = self.group_words();
        let panel = &self.words[panel * self.panel_words()..][..self.panel_words()];
        for (g, words) in panel.chunks_exact(group_words).enumerate() {
            let (scales, codes) = words.split_at(SCALE_WORDS);
            for (j, codes) in as_codes(codes).chunks_exact(LANES).enumerate() {
                put(
                    g * self.group + j,
                    std::array::from_fn(|l| {
                        let (step, offset) = (scales[l], scales[LANES + l]);
                        coded_value(codes[l], f32::from_bits(step), f32::from_bits(offset))
                    }),
                );
            }
        }
    }

    /// Row `row`'s f32 values into `out` (`cols` long).
    pub fn decode_row(&self, row: usize, out: &mut [f32]) {
        let lane = row % LANES;
        self.each_value(row / LANES, |i, values| out[i] = values[lane]);
    }

    /// The f32 values of `panels`' rows into `out`, element `i` of the `j`-th row at
    /// `i · width + j`, `width` being eight a panel: the panels' rows as a strided matrix.
    pub(super) fn decode_panels(&self, panels: std::ops::Range<usize>, out: &mut [f32]) {
        let width = panels.len() * LANES;
        debug_assert_eq!(out.len(), self.cols * width);
        for (j, panel) in panels.enumerate() {
            self.each_value(panel, |i, values| {
                out[i * width + j * LANES..][..LANES].copy_from_slice(&values)
            });
        }
    }
}

/// Words of codes as the codes, in memory order.
fn as_codes(words: &[u32]) -> &[i8] {
    // SAFETY: the bytes of initialised `u32`s are initialised, any byte is a valid `i8`,
    // and `i8` needs no alignment; the slice covers exactly the words' bytes.
    unsafe { std::slice::from_raw_parts(words.as_ptr().cast::<i8>(), size_of_val(words)) }
}

/// Words of codes as the codes, to be written.
fn as_codes_mut(words: &mut [u32]) -> &mut [i8] {
    // SAFETY: as `as_codes`; any `i8` written leaves every word a valid `u32`, and the
    // slice borrows the words mutably for its life.
    unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<i8>(), size_of_val(words)) }
}

/// `out[rows × n] = x[rows × k] · w[n × k]ᵀ`, or `out +=` it when `accumulate`, for up to
/// [`FEW_ROWS`] rows, over the current rayon pool.
pub(super) fn matmul(x: &[f32], rows: usize, w: &CodedPanels, out: &mut [f32], accumulate: bool) {
    assert!(x.len() == rows * w.cols && out.len() == rows * w.rows);
    let panels = w.panels();
    let per_task = panels
        .div_ceil(rayon::current_num_threads() * TASKS_A_THREAD)
        .max(MIN_PANELS_A_TASK);
    let product = Product {
        x,
        rows,
        w,
        accumulate,
        out: SharedOut(out.as_mut_ptr()),
    };
    (0..panels.div_ceil(per_task))
        .into_par_iter()
        .for_each(|task| {
            let first = task * per_task;
            // SAFETY: tasks write disjoint panels' columns of `out`, which outlives them,
            // and nothing else reads or writes it meanwhile.
            unsafe { product.panels(first..(first + per_task).min(panels)) }
        });
}

/// The operands of one product.
struct Product<'a> {
    x: &'a [f32],
    rows: usize,
    w: &'a CodedPanels,
    accumulate: bool,
    out: SharedOut,
}

impl Product<'_> {
    /// Writes the columns of `panels` in every row of `out`.
    ///
    /// # Safety
    /// `out` holds `rows × w.rows` elements, and no other thread touches these columns.
    unsafe fn panels(&self, panels: std::ops::Range<usize>) {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            return avx2::panels(self, panels);
        }
        self.portable(panels)
    }

    /// [`Self::panels`] on any CPU: each panel's values at `i` met by every row's `x[i]`.
    unsafe fn portable(&self, panels: std::ops::Range<usize>) {
        let (k, group) = (self.w.cols, self.w.group);
        for panel in panels {
            let mut sums = vec![[0.0f32; LANES]; self.rows];
            let mut parts = vec![[0.0f32; LANES]; self.rows];
            self.w.each_value(panel, |i, values| {
                for (row, parts) in parts.iter_mut().enumerate() {
                    let x = self.x[row * k + i];
                    for (part, value) in parts.iter_mut().zip(values) {
                        *part = x.mul_add(value, *part);
                    }
                }
                if (i + 1) % group == 0 {
                    for (sums, parts) in sums.iter_mut().zip(&mut parts) {
                        for (sum, part) in sums.iter_mut().zip(parts) {
                            *sum += std::mem::take(part);
                        }
                    }
                }
            });
            for (row, sums) in sums.iter().enumerate() {
                unsafe { self.write(row, panel, sums) };
            }
        }
    }

    /// Stores row `row`'s sums for `panel`'s columns (those inside the weight), or adds them
    /// where `accumulate`.
    ///
    /// # Safety
    /// As [`Self::panels`], `panel` being one of its panels.
    #[inline(always)]
    unsafe fn write(&self, row: usize, panel: usize, sums: &[f32; LANES]) {
        let n = self.w.rows;
        let columns = panel * LANES..((panel + 1) * LANES).min(n);
        for (column, &sum) in columns.zip(sums) {
            let at = unsafe { &mut *self.out.0.add(row * n + column) };
            *at = if self.accumulate { *at + sum } else { sum };
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{Product, BLOCK_BYTES, BLOCK_TILE_ROWS, LANES, SCALE_WORDS, TILE_ROWS};
    use crate::host_ops::PANEL_VALUES;
    use std::arch::x86_64::*;

    /// [`Product::panels`] compiled for AVX2 and FMA.
    ///
    /// # Safety
    /// As [`Product::panels`]; the CPU has AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn panels(product: &Product, panels: std::ops::Range<usize>) {
        const { assert!(TILE_ROWS == 3 && BLOCK_TILE_ROWS == 4) };
        match product.rows {
            0 => {}
            1 => product.as_read::<1, 4>(panels),
            2 => product.as_read::<2, 4>(panels),
            3 => product.as_read::<3, 2>(panels),
            _ => product.blocks(panels),
        }
    }

    impl Product<'_> {
        /// Where panel `panel` starts; the next panels follow `panel_words` apart.
        #[inline(always)]
        fn panel_at(&self, panel: usize) -> *const u32 {
            self.w.words[panel * self.w.panel_words()..].as_ptr()
        }

        /// The `R` input rows against `panels`, `P` panels at a time, then one at a time,
        /// each decoded as it is read.
        #[inline(always)]
        unsafe fn as_read<const R: usize, const P: usize>(&self, panels: std::ops::Range<usize>) {
            let mut first = panels.start;
            while panels.end - first >= P {
                self.read_tile::<R, P>(first);
                first += P;
            }
            for panel in first..panels.end {
                self.read_tile::<R, 1>(panel);
            }
        }

        /// The `R` input rows against panels `first..first + P`: for each group, the panels'
        /// steps and offsets; for each `i` in it, the rows' `x[i]` broadcast and each panel's
        /// eight values decoded once for them.
        #[inline(always)]
        unsafe fn read_tile<const R: usize, const P: usize>(&self, first: usize) {
            let (k, group) = (self.w.cols, self.w.group);
            let at = self.panel_at(first);
            let (panel_words, group_words) = (self.w.panel_words(), self.w.group_words());
            let x = self.x.as_ptr();
            let mut totals = [[_mm256_setzero_ps(); P]; R];
            for g in 0..self.w.groups() {
                let mut acc = [[_mm256_setzero_ps(); P]; R];
                let mut groups = [(_mm256_setzero_ps(), _mm256_setzero_ps(), at as *const i8); P];
                for (p, groups) in groups.iter_mut().enumerate() {
                    *groups = group_at(at.add(p * panel_words), g, group_words);
                }
                for j in 0..group {
                    let i = g * group + j;
                    let mut xs = [_mm256_setzero_ps(); R];
                    for (r, xs) in xs.iter_mut().enumerate() {
                        *xs = _mm256_broadcast_ss(&*x.add(r * k + i));
                    }
                    for (p, &(steps, offsets, codes)) in groups.iter().enumerate() {
                        let values = decode(codes.add(j * LANES), steps, offsets);
                        for (acc, xs) in acc.iter_mut().zip(&xs) {
                            acc[p] = _mm256_fmadd_ps(*xs, values, acc[p]);
                        }
                    }
                }
                add_parts(&mut totals, &acc);
            }
            self.write_tile(0, first, &totals);
        }

        /// `panels` in blocks of about [`BLOCK_BYTES`] decoded once; each tile of input rows
        /// meets every panel of a block.
        #[inline(always)]
        unsafe fn blocks(&self, panels: std::ops::Range<usize>) {
            let panel_floats = self.w.cols * LANES;
            let block = (BLOCK_BYTES / (panel_floats.max(1) * size_of::<f32>())).max(1);
            // Taken out of the thread's slot, not borrowed in a closure: a closure would not
            // be compiled for AVX2.
            let mut decoded = PANEL_VALUES.take();
            decoded.resize(block.min(panels.len()) * panel_floats, 0.0);
            self.blocks_into(panels, block, &mut decoded);
            PANEL_VALUES.set(decoded);
        }

        /// [`Self::blocks`], `block` panels at a time, decoded into `decoded`.
        #[inline(always)]
        unsafe fn blocks_into(
            &self,
            panels: std::ops::Range<usize>,
            block: usize,
            decoded: &mut [f32],
        ) {
            let (k, group) = (self.w.cols, self.w.group);
            let panel_floats = k * LANES;
            let mut first = panels.start;
            while first < panels.end {
                let block = first..(first + block).min(panels.end);
                for (j, panel) in block.clone().enumerate() {
                    let at = self.panel_at(panel);
                    let out = decoded[j * panel_floats..].as_mut_ptr();
                    for g in 0..self.w.groups() {
                        let (steps, offsets, codes) = group_at(at, g, self.w.group_words());
                        for j in 0..group {
                            let values = decode(codes.add(j * LANES), steps, offsets);
                            _mm256_storeu_ps(out.add((g * group + j) * LANES), values);
                        }
                    }
                }
                let mut row = 0;
                while row < self.rows {
                    let decoded = &decoded[..block.len() * panel_floats];
                    row += match self.rows - row {
                        1 => self.block_tiles::<1, 4>(row, block.start, decoded),
                        2 => self.block_tiles::<2, 2>(row, block.start, decoded),
                        3 => self.block_tiles::<3, 2>(row, block.start, decoded),
                        _ => self.block_tiles::<4, 2>(row, block.start, decoded),
                    };
                }
                first = block.end;
            }
        }

        /// Input rows `row..row + R` against a block's decoded panels (the first of them
        /// panel `first`), `P` at a time, then one at a time; returns `R`.
        #[inline(always)]
        unsafe fn block_tiles<const R: usize, const P: usize>(
            &self,
            row: usize,
            first: usize,
            decoded: &[f32],
        ) -> usize {
            let panel_floats = self.w.cols * LANES;
            let panels = decoded.len() / panel_floats.max(1);
            let mut j = 0;
            while panels - j >= P {
                self.block_tile::<R, P>(row, first + j, &decoded[j * panel_floats..]);
                j += P;
            }
            for j in j..panels {
                self.block_tile::<R, 1>(row, first + j, &decoded[j * panel_floats..]);
            }
            R
        }

        /// Input rows `row..row + R` against `P` decoded panels from `decoded` (panel
        /// `first` on): for each `i`, the rows' `x[i]` broadcast and each panel's eight values
        /// loaded once for them.
        #[inline(always)]
        unsafe fn block_tile<const R: usize, const P: usize>(
            &self,
            row: usize,
            first: usize,
            decoded: &[f32],
        ) {
            let (k, group) = (self.w.cols, self.w.group);
            debug_assert!(decoded.len() >= P * k * LANES);
            let x = self.x.as_ptr().add(row * k);
            let values = decoded.as_ptr();
            let mut totals = [[_mm256_setzero_ps(); P]; R];
            for g in 0..self.w.groups() {
                let mut acc = [[_mm256_setzero_ps(); P]; R];
                for i in g * group..(g + 1) * group {
                    let mut xs = [_mm256_setzero_ps(); R];
                    for (r, xs) in xs.iter_mut().enumerate() {
                        *xs = _mm256_broadcast_ss(&*x.add(r * k + i));
                    }
                    for p in 0..P {
                        let values = _mm256_loadu_ps(values.add((p * k + i) * LANES));
                        for (acc, xs) in acc.iter_mut().zip(&xs) {
                            acc[p] = _mm256_fmadd_ps(*xs, values, acc[p]);
                        }
                    }
                }
                add_parts(&mut totals, &acc);
            }
            self.write_tile(row, first, &totals);
        }

        /// A tile's sums: input rows `row..row + R`, panels `first..first + P`.
        #[inline(always)]
        unsafe fn write_tile<const R: usize, const P: usize>(
            &self,
            row: usize,
            first: usize,
            acc: &[[__m256; P]; R],
        ) {
            for (r, acc) in acc.iter().enumerate() {
                for (p, acc) in acc.iter().enumerate() {
                    let mut sums = [0.0f32; LANES];
                    _mm256_storeu_ps(sums.as_mut_ptr(), *acc);
                    self.write(row + r, first + p, &sums);
                }
            }
        }
    }

    /// Group `g` of the panel at `at`: its steps and offsets, and where its codes start.
    #[inline(always)]
    unsafe fn group_at(
        at: *const u32,
        g: usize,
        group_words: usize,
    ) -> (__m256, __m256, *const i8) {
        unsafe {
            let scales = at.add(g * group_words);
            (
                _mm256_loadu_ps(scales as *const f32),
                _mm256_loadu_ps((scales as *const f32).add(LANES)),
                scales.add(SCALE_WORDS) as *const i8,
            )
        }
    }

    /// A group's sums added to the totals.
    #[inline(always)]
    unsafe fn add_parts<const R: usize, const P: usize>(
        totals: &mut [[__m256; P]; R],
        parts: &[[__m256; P]; R],
    ) {
        for (totals, parts) in totals.iter_mut().zip(parts) {
            for (total, part) in totals.iter_mut().zip(parts) {
                *total = unsafe { _mm256_add_ps(*total, *part) };
            }
        }
    }

    /// Eight codes at `codes` widened to i32 and converted, then multiplied by the steps and
    /// added to the offsets in two roundings, as [`canopy_core::coded_value`] computes them.
    #[inline(always)]
    unsafe fn decode(codes: *const i8, steps: __m256, offsets: __m256) -> __m256 {
        unsafe {
            let codes = _mm_loadl_epi64(codes as *const __m128i);
            let values = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes));
            _mm256_add_ps(_mm256_mul_ps(values, steps), offsets)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An `n × k` coded matrix in groups of `group`, every code, step and offset drawn from
    /// `seed`.
    fn coded(n: usize, k: usize, group: usize, seed: usize) -> CodedMatrix {
        let mut w = CodedMatrix::zeros(n, k, group).unwrap();
        for (i, code) in w.codes.iter_mut().enumerate() {
            *code = ((i + seed) * 7919 % 251) as i8;
        }
        for (i, (step, offset)) in w.steps.iter_mut().zip(&mut w.offsets).enumerate() {
            *step = ((i + seed) * 31 % 97) as f32 * 1e-4;
            *offset = ((i + seed) * 17 % 89) as f32 * 1e-3 - 0.04;
        }
        w
    }

    /// Panels hold the matrix's values: each row decodes to the row-major decode, and the
    /// prompt's strided decode puts them where it says.
    #[test]
    fn panels_decode_to_the_matrix_values() {
        for (n, k, group) in [(8, 32, 32), (13, 64, 16), (30, 48, 8)] {
            let m = coded(n, k, group, n);
            let panels = CodedPanels::pack(&m);
            let values = m.to_f32();
            let mut row = vec![f32::NAN; k];
            for r in 0..n {
                panels.decode_row(r, &mut row);
                assert_eq!(row, values[r * k..(r + 1) * k], "row {r} of {n} × {k}");
            }
            let all = 0..panels.panels();
            let width = all.len() * LANES;
            let mut strided = vec![f32::NAN; k * width];
            panels.decode_panels(all, &mut strided);
            for (r, i) in (0..n).flat_map(|r| (0..k).map(move |i| (r, i))) {
                assert_eq!(strided[i * width + r], values[r * k + i]);
            }
        }
    }

    /// Where the CPU has AVX2, its path gives the portable path's bits at every row count a
    /// decode step takes (decoded as read, and in blocks, with rows past the last whole tile),
    /// for weights whose last panel is whole or not, in groups of 8, 16 and 32, added or not.
    #[test]
    fn the_avx2_path_equals_the_portable_one() {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            let k = 96;
            let x: Vec<f32> = (0..FEW_ROWS * k)
                .map(|i| (i * 104_729 % 997) as f32 / 997.0 - 0.5)
                .collect();
            for (n, group) in [(40, 8), (203, 16), (61, 32)] {
                let w = CodedPanels::pack(&coded(n, k, group, n));
                for rows in [1, 2, 3, 4, 5, 6, 7, 9, 32] {
                    for accumulate in [false, true] {
                        let start: Vec<f32> = (0..rows * n).map(|i| (i % 3) as f32).collect();
                        let (mut fast, mut portable) = (start.clone(), start.clone());
                        for (out, use_avx2) in [(&mut fast, true), (&mut portable, false)] {
                            let product = Product {
                                x: &x[..rows * k],
                                rows,
                                w: &w,
                                accumulate,
                                out: SharedOut(out.as_mut_ptr()),
                            };
                            let all = 0..w.panels();
                            // SAFETY: `out` holds rows × n elements; one thread writes it.
                            unsafe {
                                if use_avx2 {
                                    avx2::panels(&product, all)
                                } else {
                                    product.portable(all)
                                }
                            }
                        }
                        let same = fast.iter().zip(&portable);
                        assert!(
                            same.clone().all(|(a, b)| a.to_bits() == b.to_bits()),
                            "{rows} rows, {n} × {k} in groups of {group}, accumulate {accumulate}"
                        );
                    }
                }
            }
            return;
        }
        eprintln!("no AVX2 and FMA here: only the portable path runs");
    }
}
