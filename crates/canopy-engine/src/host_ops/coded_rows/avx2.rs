//! [`Product::panels`] on AVX2 and FMA, for codes stored a byte each or two to a byte
//! (`NIBBLES`): the same operations as the portable path, eight lanes at a time.

use super::{
    Product, BLOCK_BYTES, BLOCK_TILE_ROWS, FEW_ROWS, LANES, NIBBLES_A_WORD, SCALE_WORDS, TILE_ROWS,
};
use crate::host_ops::PANEL_VALUES;
use std::arch::x86_64::*;

/// [`Product::panels`] compiled for AVX2 and FMA.
///
/// # Safety
/// As [`Product::panels`]; the CPU has AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn panels(product: &Product, panels: std::ops::Range<usize>) {
    const { assert!(TILE_ROWS == 3 && BLOCK_TILE_ROWS == 4) };
    match product.w.nibble_base {
        None => product.rows_of::<false>(panels),
        Some(_) => product.rows_of::<true>(panels),
    }
}

/// Bytes of a cache line: the step between prefetches.
const CACHE_LINE: usize = 64;

/// A group's place in a panel: its steps, its offsets with the nibbles' base taken in, and
/// where its codes start.
type GroupAt = (__m256, __m256, *const i8);

impl Product<'_> {
    /// Every input row against `panels`, codes stored two to a byte where `NIBBLES`.
    #[inline(always)]
    unsafe fn rows_of<const NIBBLES: bool>(&self, panels: std::ops::Range<usize>) {
        match self.rows {
            0 => {}
            1 => self.as_read::<NIBBLES, 1, 4>(panels),
            2 if NIBBLES => self.as_read::<NIBBLES, 2, 2>(panels),
            2 => self.as_read::<NIBBLES, 2, 4>(panels),
            3 if NIBBLES => self.as_read::<NIBBLES, 3, 1>(panels),
            3 => self.as_read::<NIBBLES, 3, 2>(panels),
            _ => self.blocks::<NIBBLES>(panels),
        }
    }

    /// Where panel `panel` starts; the next panels follow `panel_words` apart.
    #[inline(always)]
    fn panel_at(&self, panel: usize) -> *const u32 {
        self.w.words[panel * self.w.panel_words()..].as_ptr()
    }

    /// Group `g` of the panel at `at`.
    #[inline(always)]
    unsafe fn group_at(&self, at: *const u32, g: usize) -> GroupAt {
        unsafe {
            let scales = at.add(g * self.w.group_words());
            let steps = _mm256_loadu_ps(scales as *const f32);
            let offsets = _mm256_loadu_ps((scales as *const f32).add(LANES));
            let base = _mm256_set1_ps(f32::from(self.w.base()));
            (
                steps,
                _mm256_fmadd_ps(steps, base, offsets),
                scales.add(SCALE_WORDS) as *const i8,
            )
        }
    }

    /// Asks for group `g` of the `P` panels from the one at `at` to be brought into L1: a
    /// product reads its panels one stream a panel, and the hardware's prefetcher alone
    /// runs too little ahead of it. The panels may lie past the weight's end, where nothing
    /// is read.
    #[inline(always)]
    unsafe fn prefetch_groups<const P: usize>(&self, at: *const u32, g: usize) {
        let group_bytes = self.w.group_words() * size_of::<u32>();
        for p in 0..P {
            let group = at
                .wrapping_add(p * self.w.panel_words() + g * self.w.group_words())
                .cast::<i8>();
            for line in (0..group_bytes).step_by(CACHE_LINE) {
                _mm_prefetch::<_MM_HINT_T0>(group.wrapping_add(line));
            }
        }
    }

    /// Group `g` of `P` consecutive panels, the first at `at`. A loop, not a closure: a
    /// closure would not be compiled for AVX2.
    #[inline(always)]
    unsafe fn groups_at<const P: usize>(&self, at: *const u32, g: usize) -> [GroupAt; P] {
        let mut groups = [(_mm256_setzero_ps(), _mm256_setzero_ps(), std::ptr::null()); P];
        for (p, group) in groups.iter_mut().enumerate() {
            *group = self.group_at(at.add(p * self.w.panel_words()), g);
        }
        groups
    }

    /// The `R` input rows against `panels`, `P` panels at a time, then one at a time, each
    /// converted as it is read.
    #[inline(always)]
    unsafe fn as_read<const NIBBLES: bool, const R: usize, const P: usize>(
        &self,
        panels: std::ops::Range<usize>,
    ) {
        let mut first = panels.start;
        while panels.end - first >= P {
            self.read_tile::<NIBBLES, R, P>(first);
            first += P;
        }
        for panel in first..panels.end {
            self.read_tile::<NIBBLES, R, 1>(panel);
        }
    }

    /// The `R` input rows against panels `first..first + P`: for each `i` of a group, the
    /// rows' `x[i]` broadcast and each panel's eight codes converted once for them.
    #[inline(always)]
    unsafe fn read_tile<const NIBBLES: bool, const R: usize, const P: usize>(&self, first: usize) {
        let (k, group) = (self.w.cols, self.w.group);
        let at = self.panel_at(first);
        let x = self.x.as_ptr();
        let mut totals = [[_mm256_setzero_ps(); P]; R];
        for g in 0..self.w.groups() {
            let mut parts = [[_mm256_setzero_ps(); P]; R];
            let groups = self.groups_at::<P>(at, g);
            // The next tile's panels.
            self.prefetch_groups::<P>(at.wrapping_add(P * self.w.panel_words()), g);
            for run in 0..group / RUN {
                let runs = groups.map(|(_, _, codes)| Run::<NIBBLES>::load(codes, run));
                for t in 0..RUN {
                    let i = g * group + run * RUN + t;
                    let mut xs = [_mm256_setzero_ps(); R];
                    for (r, xs) in xs.iter_mut().enumerate() {
                        *xs = _mm256_broadcast_ss(&*x.add(r * k + i));
                    }
                    for (p, run) in runs.iter().enumerate() {
                        let codes = run.codes(t);
                        for (parts, xs) in parts.iter_mut().zip(&xs) {
                            parts[p] = _mm256_fmadd_ps(*xs, codes, parts[p]);
                        }
                    }
                }
            }
            self.close_group(&mut totals, &parts, &groups, 0, g);
        }
        self.write_tile(0, first, &totals);
    }

    /// The totals of input rows `row..row + R` take a group: its offsets times the rows'
    /// group sums, then its chains times its steps.
    #[inline(always)]
    unsafe fn close_group<const R: usize, const P: usize>(
        &self,
        totals: &mut [[__m256; P]; R],
        parts: &[[__m256; P]; R],
        groups: &[GroupAt; P],
        row: usize,
        g: usize,
    ) {
        let groups_a_row = self.w.groups();
        for (r, (totals, parts)) in totals.iter_mut().zip(parts).enumerate() {
            let x_sum = _mm256_broadcast_ss(&self.group_sums[(row + r) * groups_a_row + g]);
            for ((total, part), &(steps, offsets, _)) in totals.iter_mut().zip(parts).zip(groups) {
                *total = _mm256_fmadd_ps(steps, *part, _mm256_fmadd_ps(offsets, x_sum, *total));
            }
        }
    }

    /// `panels` in blocks of about [`BLOCK_BYTES`] converted once; each two panels of a block
    /// meet every input row ([`Self::block_panels`]).
    #[inline(always)]
    unsafe fn blocks<const NIBBLES: bool>(&self, panels: std::ops::Range<usize>) {
        let panel_floats = self.w.cols * LANES;
        let block = (BLOCK_BYTES / (panel_floats.max(1) * size_of::<f32>())).max(1);
        // Taken out of the thread's slot, not borrowed in a closure: a closure would not be
        // compiled for AVX2.
        let mut converted = PANEL_VALUES.take();
        converted.resize(block.min(panels.len()) * panel_floats, 0.0);
        self.blocks_into::<NIBBLES>(panels, block, &mut converted);
        PANEL_VALUES.set(converted);
    }

    /// [`Self::blocks`], `block` panels at a time, converted into `converted`.
    #[inline(always)]
    unsafe fn blocks_into<const NIBBLES: bool>(
        &self,
        panels: std::ops::Range<usize>,
        block: usize,
        converted: &mut [f32],
    ) {
        let (k, group) = (self.w.cols, self.w.group);
        let panel_floats = k * LANES;
        let mut first = panels.start;
        while first < panels.end {
            let block = first..(first + block).min(panels.end);
            for (j, panel) in block.clone().enumerate() {
                let at = self.panel_at(panel);
                let out = converted[j * panel_floats..].as_mut_ptr();
                for g in 0..self.w.groups() {
                    self.prefetch_groups::<1>(at.wrapping_add(self.w.panel_words()), g);
                    let (_, _, codes) = self.group_at(at, g);
                    for run in 0..group / RUN {
                        let codes = Run::<NIBBLES>::load(codes, run);
                        for t in 0..RUN {
                            let i = g * group + run * RUN + t;
                            _mm256_storeu_ps(out.add(i * LANES), codes.codes(t));
                        }
                    }
                }
            }
            let converted = &converted[..block.len() * panel_floats];
            let mut j = 0;
            while block.len() - j >= 2 {
                self.block_panels::<2>(block.start + j, &converted[j * panel_floats..]);
                j += 2;
            }
            if j < block.len() {
                self.block_panels::<1>(block.start + j, &converted[j * panel_floats..]);
            }
            first = block.end;
        }
    }

    /// Every input row against `P` converted panels from `converted` (panel `first` on):
    /// for each group, tiles of up to [`BLOCK_TILE_ROWS`] rows chain its elements, and the
    /// group closes into the rows' totals, which wait in memory while the next tile runs.
    #[inline(always)]
    unsafe fn block_panels<const P: usize>(&self, first: usize, converted: &[f32]) {
        debug_assert!(self.rows <= FEW_ROWS);
        let mut totals = [[_mm256_setzero_ps(); P]; FEW_ROWS];
        let totals = &mut totals[..self.rows];
        let at = self.panel_at(first);
        for g in 0..self.w.groups() {
            let groups = self.groups_at::<P>(at, g);
            let mut row = 0;
            while row < self.rows {
                row += match self.rows - row {
                    1 => self.group_tile::<1, P>(row, g, &groups, converted, totals),
                    2 => self.group_tile::<2, P>(row, g, &groups, converted, totals),
                    3 => self.group_tile::<3, P>(row, g, &groups, converted, totals),
                    _ => self.group_tile::<4, P>(row, g, &groups, converted, totals),
                };
            }
        }
        for (row, totals) in totals.iter().enumerate() {
            self.write_tile::<1, P>(row, first, &[*totals]);
        }
    }

    /// Group `g` of input rows `row..row + R` against `P` converted panels: for each `i`,
    /// the rows' `x[i]` broadcast and each panel's eight codes loaded once for them; then
    /// the group closes into the rows' totals. Returns `R`.
    #[inline(always)]
    unsafe fn group_tile<const R: usize, const P: usize>(
        &self,
        row: usize,
        g: usize,
        groups: &[GroupAt; P],
        converted: &[f32],
        totals: &mut [[__m256; P]],
    ) -> usize {
        let (k, group) = (self.w.cols, self.w.group);
        debug_assert!(converted.len() >= P * k * LANES);
        let x = self.x.as_ptr().add(row * k);
        let codes = converted.as_ptr();
        let mut parts = [[_mm256_setzero_ps(); P]; R];
        for i in g * group..(g + 1) * group {
            let mut xs = [_mm256_setzero_ps(); R];
            for (r, xs) in xs.iter_mut().enumerate() {
                *xs = _mm256_broadcast_ss(&*x.add(r * k + i));
            }
            for p in 0..P {
                let codes = _mm256_loadu_ps(codes.add((p * k + i) * LANES));
                for (parts, xs) in parts.iter_mut().zip(&xs) {
                    parts[p] = _mm256_fmadd_ps(*xs, codes, parts[p]);
                }
            }
        }
        let totals: &mut [[__m256; P]; R] = (&mut totals[row..row + R]).try_into().unwrap();
        self.close_group(totals, &parts, groups, row, g);
        R
    }

    /// A tile's sums: input rows `row..row + R`, panels `first..first + P`.
    #[inline(always)]
    unsafe fn write_tile<const R: usize, const P: usize>(
        &self,
        row: usize,
        first: usize,
        totals: &[[__m256; P]; R],
    ) {
        for (r, totals) in totals.iter().enumerate() {
            for (p, total) in totals.iter().enumerate() {
                let mut sums = [0.0f32; LANES];
                _mm256_storeu_ps(sums.as_mut_ptr(), *total);
                self.write(row + r, first + p, &sums);
            }
        }
    }
}

/// Elements of a group read together: a word of nibbles, and as many bytes.
const RUN: usize = NIBBLES_A_WORD;

/// The codes of [`RUN`] consecutive elements of a group's eight lanes: one vector of
/// nibbles, or where the bytes start.
#[derive(Clone, Copy)]
enum Run<const NIBBLES: bool> {
    Nibbles(__m256i),
    Bytes(*const i8),
}

impl<const NIBBLES: bool> Run<NIBBLES> {
    /// Run `run` of a group whose codes start at `codes`.
    #[inline(always)]
    unsafe fn load(codes: *const i8, run: usize) -> Self {
        unsafe {
            if NIBBLES {
                let words = codes.add(run * LANES * size_of::<u32>());
                Run::Nibbles(_mm256_loadu_si256(words as *const __m256i))
            } else {
                Run::Bytes(codes.add(run * RUN * LANES))
            }
        }
    }

    /// Element `t` of the run's eight lanes as f32: a byte each, sign-extended, or a nibble
    /// (above the base, which the offsets hold).
    #[inline(always)]
    unsafe fn codes(self, t: usize) -> __m256 {
        unsafe {
            let codes = match self {
                Run::Nibbles(words) => nibble(words, t),
                Run::Bytes(at) => {
                    _mm256_cvtepi8_epi32(_mm_loadl_epi64(at.add(t * LANES) as *const __m128i))
                }
            };
            _mm256_cvtepi32_ps(codes)
        }
    }
}

/// Nibble `t` of each word: a shift by a constant and a mask, the first without the shift
/// and the last without the mask.
#[inline(always)]
unsafe fn nibble(words: __m256i, t: usize) -> __m256i {
    let mask = _mm256_set1_epi32(0xf);
    match t {
        0 => _mm256_and_si256(words, mask),
        1 => _mm256_and_si256(_mm256_srli_epi32::<4>(words), mask),
        2 => _mm256_and_si256(_mm256_srli_epi32::<8>(words), mask),
        3 => _mm256_and_si256(_mm256_srli_epi32::<12>(words), mask),
        4 => _mm256_and_si256(_mm256_srli_epi32::<16>(words), mask),
        5 => _mm256_and_si256(_mm256_srli_epi32::<20>(words), mask),
        6 => _mm256_and_si256(_mm256_srli_epi32::<24>(words), mask),
        _ => _mm256_srli_epi32::<28>(words),
    }
}
