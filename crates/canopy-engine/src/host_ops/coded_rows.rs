//! A quantized weight laid out for the CPU's products, and its products of up to
//! [`FEW_ROWS`] rows: a decode step's.
//!
//! [`CodedPanels`] holds a [`CodedMatrix`] with every eight weight rows (output columns)
//! interleaved into a panel: element `i` of the panel's eight rows is eight consecutive
//! codes, and a group's eight steps (and offsets) are one vector, stored before the group's
//! codes so that a panel is read as one stream. Where every code of the weight lies in a
//! range of sixteen (a 4-bit format's), the codes are stored two to a byte, less the range's
//! first code: SmolLM2's layers then take 0.75 bytes a weight with their steps and offsets,
//! not 1.25, and a step that streams its weights from memory reads that much less.
//!
//! A product takes the steps and offsets out of the sum: for each group,
//! `Σ x[i]·(step·c[i] + offset) = step · Σ x[i]·c[i] + offset · Σ x[i]`. Eight codes of a panel
//! at `i` are loaded and widened (bytes) or shifted and masked out of a vector of words
//! (nibbles), converted once, and meet a broadcast `x[i]` in one fused multiply-add whose
//! lanes are eight output elements; the step and the offset are applied once a group, in two
//! fused multiply-adds.
//!
//! Every output element takes the same operations, whatever the row count and however rows
//! and panels are cut: for each group, one chain of fused multiply-adds over its `i` in
//! order, from zero; then the total takes `offset · Σ x[i]` (the input's group sum, added in
//! order from zero) and `step · chain`, groups in order. A row's result is therefore the same
//! bits alone or in a batch, and the AVX2 path equals the portable one. A chain is a group
//! long (16 or 32), so rounding grows with the group, not with the row.
//! - Up to [`TILE_ROWS`] input rows (one sequence, or a few) convert the codes as they read
//!   them, as many panels at a time as AVX2's 16 registers hold accumulators for (and, for
//!   nibbles, a vector of words a panel): four for one row, four (bytes) or two (nibbles)
//!   for two, two or one for three.
//! - More rows convert a block of panels once into memory that stays in L2. For each two
//!   panels of it and each group, tiles of [`BLOCK_TILE_ROWS`] input rows (eight
//!   accumulators) chain the group, and every row's totals wait in memory between groups:
//!   kept in registers across a tile's groups, they and the chains would not fit AVX2's 16.
//!
//! While a tile reads a group, it asks for the same group of the next tile's panels (and a
//! block's conversion, of the next panel): a step streams every weight once, and with the
//! hardware's prefetcher alone one row took about a quarter longer.

use super::SharedOut;
use canopy_core::{coded_value, CodedMatrix};
use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
mod avx2;

/// Products of up to this many rows take this path; more (a prompt's) decode panels for
/// `gemm`.
pub(super) const FEW_ROWS: usize = 32;
/// Output columns a panel interleaves: one AVX2 register of f32.
pub(super) const LANES: usize = 8;
/// Input rows that convert the codes as they read them, at most.
const TILE_ROWS: usize = 3;
/// Input rows a tile over converted panels takes.
const BLOCK_TILE_ROWS: usize = 4;
/// Converted panels a block holds, in bytes at most: within L2 beside the input rows.
const BLOCK_BYTES: usize = 96 << 10;
/// Panels a task takes at least.
const MIN_PANELS_A_TASK: usize = 8;
/// Tasks a thread gets, so that threads that finish early take more.
const TASKS_A_THREAD: usize = 8;
/// Words of a group's steps and offsets.
const SCALE_WORDS: usize = 2 * LANES;
/// Codes a range must hold at most for them to be stored two to a byte.
const NIBBLE_CODES: i16 = 16;
/// Codes a word holds when they are stored two to a byte.
const NIBBLES_A_WORD: usize = 8;

/// A coded `rows × cols` weight, its rows in panels of eight, the last one padded with
/// rows of zero codes, steps and offsets.
///
/// A panel is one run of memory, a group after another: the group's eight steps, its eight
/// offsets, then its codes. Codes stored a byte each are at `[i][lane]`; codes stored two
/// to a byte (`nibble_base`) are at `[i / 8][lane]` in words of eight, element `i` in bits
/// `4 · (i % 8)`: one vector load holds eight elements of all eight lanes, and a shift and
/// a mask take one out. A product reads each panel as one stream.
#[derive(Debug, Clone, PartialEq)]
pub struct CodedPanels {
    pub rows: usize,
    pub cols: usize,
    group: usize,
    /// Where codes are stored two to a byte: the code that a stored zero stands for.
    /// Products take it into the offsets: `step · (base + n) + offset` is
    /// `step · n + (step · base + offset)`.
    nibble_base: Option<i8>,
    /// The panels, in words of four bytes: the f32 steps and offsets as their bits, then the
    /// codes.
    words: Vec<u32>,
}

impl CodedPanels {
    /// Whether a weight in groups of `group` elements can be packed: products read a group's
    /// codes eight elements at a time, as one word of nibbles. Every quantized type a model
    /// file holds has groups of 16 or 32.
    pub fn packs_groups_of(group: usize) -> bool {
        group.is_multiple_of(NIBBLES_A_WORD)
    }

    /// `m` in panels. Its groups are whole within a row, as [`CodedMatrix`] keeps them, and
    /// [`Self::packs_groups_of`] their length. Its codes are stored two to a byte where they
    /// lie in a range of sixteen.
    pub fn pack(m: &CodedMatrix) -> CodedPanels {
        let (rows, cols, group) = (m.rows, m.cols, m.group);
        assert!(
            Self::packs_groups_of(group),
            "a coded weight in groups of {group} cannot be packed"
        );
        let (low, high) = m.codes.iter().fold((i8::MAX, i8::MIN), |(low, high), &c| {
            (low.min(c), high.max(c))
        });
        let nibble_base = (i16::from(high) - i16::from(low) < NIBBLE_CODES).then_some(low);
        let mut panels = CodedPanels {
            rows,
            cols,
            group,
            nibble_base,
            words: Vec::new(),
        };
        let (groups, group_words) = (panels.groups(), panels.group_words());
        panels.words = vec![0u32; panels.panels() * panels.panel_words()];
        // A panel's element `i` is its rows' elements `i`; lanes past the last row keep
        // their zeros.
        panels
            .words
            .par_chunks_mut((groups * group_words).max(1))
            .enumerate()
            .for_each(|(panel, words)| {
                let lanes = panel * LANES..((panel + 1) * LANES).min(rows);
                for (g, words) in words.chunks_exact_mut(group_words).enumerate() {
                    let (scales, codes) = words.split_at_mut(SCALE_WORDS);
                    for (lane, row) in lanes.clone().enumerate() {
                        scales[lane] = m.steps[row * groups + g].to_bits();
                        scales[LANES + lane] = m.offsets[row * groups + g].to_bits();
                        let from = &m.codes[row * cols + g * group..][..group];
                        for (i, &code) in from.iter().enumerate() {
                            match nibble_base {
                                None => as_codes_mut(codes)[i * LANES + lane] = code,
                                Some(base) => {
                                    let nibble = (i16::from(code) - i16::from(base)) as u32;
                                    codes[i / NIBBLES_A_WORD * LANES + lane] |=
                                        nibble << (4 * (i % NIBBLES_A_WORD));
                                }
                            }
                        }
                    }
                }
            });
        panels
    }

    /// The bytes the panels take.
    pub fn bytes(&self) -> usize {
        size_of_val(self.words.as_slice())
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
        let codes_a_word = if self.nibble_base.is_some() {
            NIBBLES_A_WORD
        } else {
            size_of::<u32>()
        };
        SCALE_WORDS + self.group * LANES / codes_a_word
    }

    /// Words a panel takes.
    fn panel_words(&self) -> usize {
        self.groups() * self.group_words()
    }

    /// Panel `panel`'s groups in turn, handed to `put(g, scales, codes)`: the group's steps
    /// then offsets as f32 bits, and its codes' words.
    #[inline(always)]
    fn each_group(&self, panel: usize, mut put: impl FnMut(usize, &[u32], &[u32])) {
        let panel = &self.words[panel * self.panel_words()..][..self.panel_words()];
        for (g, words) in panel.chunks_exact(self.group_words()).enumerate() {
            let (scales, codes) = words.split_at(SCALE_WORDS);
            put(g, scales, codes);
        }
    }

    /// What is stored for element `j` of a group, lane `lane`, from the group's code words:
    /// the code, or its nibble above the base.
    #[inline(always)]
    fn stored(&self, codes: &[u32], j: usize, lane: usize) -> i8 {
        match self.nibble_base {
            None => as_codes(codes)[j * LANES + lane],
            Some(_) => {
                let word = codes[j / NIBBLES_A_WORD * LANES + lane];
                ((word >> (4 * (j % NIBBLES_A_WORD))) & 0xf) as i8
            }
        }
    }

    /// The code a stored zero stands for: the nibbles' base, or zero.
    fn base(&self) -> i8 {
        self.nibble_base.unwrap_or(0)
    }

    /// Panel `panel`'s eight values at each `i` in turn, handed to `put(i, values)`.
    #[inline(always)]
    fn each_value(&self, panel: usize, mut put: impl FnMut(usize, [f32; LANES])) {
        self.each_group(panel, |g, scales, codes| {
            for j in 0..self.group {
                put(
                    g * self.group + j,
                    std::array::from_fn(|l| {
                        let (step, offset) = (scales[l], scales[LANES + l]);
                        let code = self.base() + self.stored(codes, j, l);
                        coded_value(code, f32::from_bits(step), f32::from_bits(offset))
                    }),
                );
            }
        });
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
    let group_sums: Vec<f32> = x
        .chunks_exact(w.group)
        .map(|group| group.iter().sum())
        .collect();
    let product = Product {
        x,
        group_sums: &group_sums,
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
    group_sums: &'a [f32],
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
        if super::has_avx2_and_fma() {
            return avx2::panels(self, panels);
        }
        self.portable(panels)
    }

    /// [`Self::panels`] on any CPU: each panel's codes at `i` met by every row's `x[i]`.
    unsafe fn portable(&self, panels: std::ops::Range<usize>) {
        let (k, group, groups) = (self.w.cols, self.w.group, self.w.groups());
        let base = f32::from(self.w.base());
        for panel in panels {
            let mut sums = vec![[0.0f32; LANES]; self.rows];
            self.w.each_group(panel, |g, scales, codes| {
                let mut parts = vec![[0.0f32; LANES]; self.rows];
                for j in 0..group {
                    let values: [f32; LANES] =
                        std::array::from_fn(|l| f32::from(self.w.stored(codes, j, l)));
                    for (row, parts) in parts.iter_mut().enumerate() {
                        let x = self.x[row * k + g * group + j];
                        for (part, value) in parts.iter_mut().zip(values) {
                            *part = x.mul_add(value, *part);
                        }
                    }
                }
                for (row, (sums, parts)) in sums.iter_mut().zip(&parts).enumerate() {
                    let x_sum = self.group_sums[row * groups + g];
                    for (l, (sum, part)) in sums.iter_mut().zip(parts).enumerate() {
                        let (step, offset) = (scales[l], scales[LANES + l]);
                        let (step, offset) = (f32::from_bits(step), f32::from_bits(offset));
                        let offset = step.mul_add(base, offset);
                        *sum = step.mul_add(*part, offset.mul_add(x_sum, *sum));
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

#[cfg(test)]
mod tests {
    use super::*;

    /// An `n × k` coded matrix in groups of `group`, every code, step and offset drawn from
    /// `seed`: codes of every value, or (`from`) sixteen codes from that one, which
    /// [`CodedPanels`] stores two to a byte.
    fn coded(n: usize, k: usize, group: usize, seed: usize, from: Option<i8>) -> CodedMatrix {
        let mut w = CodedMatrix::zeros(n, k, group).unwrap();
        for (i, code) in w.codes.iter_mut().enumerate() {
            *code = match from {
                None => ((i + seed) * 7919 % 251) as i8,
                Some(from) => from + ((i + seed) * 7919 % 16) as i8,
            };
        }
        for (i, (step, offset)) in w.steps.iter_mut().zip(&mut w.offsets).enumerate() {
            *step = ((i + seed) * 31 % 97) as f32 * 1e-4;
            *offset = ((i + seed) * 17 % 89) as f32 * 1e-3 - 0.04;
        }
        w
    }

    /// Panels hold the matrix's values, their codes a byte each or two to a byte: each row
    /// decodes to the row-major decode, and the prompt's strided decode puts them where it
    /// says.
    #[test]
    fn panels_decode_to_the_matrix_values() {
        let cases = [(8, 32, 32, None), (13, 64, 16, None), (30, 48, 8, None)];
        let narrow = [
            (8, 32, 32, Some(0)),
            (13, 64, 16, Some(-8)),
            (30, 48, 8, Some(100)),
        ];
        for (n, k, group, from) in cases.into_iter().chain(narrow) {
            let m = coded(n, k, group, n, from);
            let panels = CodedPanels::pack(&m);
            assert_eq!(panels.nibble_base, from, "{n} × {k} in groups of {group}");
            let scale_bytes = n.div_ceil(LANES) * LANES * (k / group) * 8;
            let code_bytes = n.div_ceil(LANES) * LANES * k / if from.is_some() { 2 } else { 1 };
            assert_eq!(panels.bytes(), scale_bytes + code_bytes);
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
    /// decode step takes (converted as read, and in blocks, with rows past the last whole
    /// tile), for weights whose last panel is whole or not, in groups of 8, 16 and 32, their
    /// codes a byte each or two to a byte, added or not.
    #[test]
    fn the_avx2_path_equals_the_portable_one() {
        #[cfg(target_arch = "x86_64")]
        if crate::host_ops::has_avx2_and_fma() {
            let k = 96;
            let x: Vec<f32> = (0..FEW_ROWS * k)
                .map(|i| (i * 104_729 % 997) as f32 / 997.0 - 0.5)
                .collect();
            let cases = [(40, 8, None), (203, 16, None), (61, 32, None)];
            let narrow = [(40, 8, Some(-8)), (203, 16, Some(0)), (61, 32, Some(3))];
            for (n, group, from) in cases.into_iter().chain(narrow) {
                let w = CodedPanels::pack(&coded(n, k, group, n, from));
                assert_eq!(w.nibble_base, from);
                let group_sums: Vec<f32> = x.chunks_exact(group).map(|g| g.iter().sum()).collect();
                for rows in [1, 2, 3, 4, 5, 6, 7, 9, 32] {
                    for accumulate in [false, true] {
                        let start: Vec<f32> = (0..rows * n).map(|i| (i % 3) as f32).collect();
                        let (mut fast, mut portable) = (start.clone(), start.clone());
                        for (out, use_avx2) in [(&mut fast, true), (&mut portable, false)] {
                            let product = Product {
                                x: &x[..rows * k],
                                group_sums: &group_sums,
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
                            "{rows} rows, {n} × {k} in groups of {group} (codes from {from:?}), \
                             accumulate {accumulate}"
                        );
                    }
                }
            }
            return;
        }
        eprintln!("no AVX2 and FMA here: only the portable path runs");
    }
}
