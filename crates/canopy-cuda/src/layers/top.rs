//! [`LayerOps::top_logits`](canopy_engine::LayerOps::top_logits) on the GPU: `logits.cu`'s
//! `top_logits` narrows each row of logits to its `k` most likely tokens in passes, each
//! taking segments of `LAYER_THREADS · TOP_ITEMS` entries to `k` keys apiece (by rounds of
//! the largest key for a few, by radix selection for more), until one segment is left, whose
//! pass writes the row's logits and tokens. A vocabulary of 128K takes two passes up to
//! `k` = 128 and four at 1,024; the logits never leave the device. `logprob_terms` reduces
//! each row to its log-normaliser and a target's logit, and `softmax_totals` each row to its
//! softmax total at a temperature, one CTA a row; `pick_logits` reads single logits and
//! `set_logits` writes them, a thread each (`walks.rs` walks the rest of a draw past a row's
//! likeliest tokens).

use super::{narrow, CudaTensor};
use crate::backend::CudaBackend;
use crate::error::{CudaError, DriverContext, Result};
use crate::launch::Params;
use canopy_core::DType;
use canopy_kernels::{Kernel, LAYER_THREADS, TOP_ITEMS};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

/// Entries one CTA of `top_logits` narrows to `k`.
const SEGMENT: usize = LAYER_THREADS as usize * TOP_ITEMS;
/// The most rows one launch covers (its grid's second dimension).
const MOST_ROWS: usize = 65_535;

impl CudaBackend {
    /// Each row's log-normaliser and the logit of its target into `out` (`rows × 2`; the
    /// caller checked the shapes and every target).
    pub(super) fn logprob_rows(
        &self,
        logits: &CudaTensor,
        targets: &[u32],
        out: &mut CudaTensor,
    ) -> Result<()> {
        self.row_reduction("logprob_terms", logits, targets, out)
    }

    /// Each row's softmax total at its temperature into `out` (`rows × 1`; the caller
    /// checked the shapes and every temperature).
    pub(super) fn total_rows(
        &self,
        logits: &CudaTensor,
        temperatures: &[f32],
        out: &mut CudaTensor,
    ) -> Result<()> {
        self.row_reduction("softmax_totals", logits, temperatures, out)
    }

    /// The logits at `picks` into `out` (`picks × 1`; the caller checked the shapes and
    /// every pick).
    pub(super) fn pick_rows(
        &self,
        logits: &CudaTensor,
        picks: &[(u32, u32)],
        out: &mut CudaTensor,
    ) -> Result<()> {
        out.drop_rounded();
        if picks.is_empty() {
            return Ok(());
        }
        let f = self.function(Kernel::Layers(DType::F32, "pick_logits"))?;
        let (flat, n, cols) = self.places("pick_logits", logits.cols, picks)?;
        let mut b = self.stream.launch_builder(&f);
        b.arg(&logits.data)
            .arg(&flat)
            .arg(&n)
            .arg(&cols)
            .arg(&mut out.data);
        // SAFETY: each pick is a (row, token) inside logits (rows × cols, checked by the
        // caller), and out holds one float a pick.
        unsafe { b.launch(self.elementwise(picks.len())) }.ctx("launching pick_logits")?;
        Ok(())
    }

    /// Sets the logits at `places` to `value` (the caller checked every place).
    pub(super) fn set_places(
        &self,
        logits: &mut CudaTensor,
        places: &[(u32, u32)],
        value: f32,
    ) -> Result<()> {
        logits.drop_rounded();
        self.set_in(&mut logits.data, logits.cols, places, value, None)
    }

    /// Sets the logits at `places` of `data` (rows of `cols`) to `values`, one a place, or
    /// to `value` where there are none (the caller checked every place).
    pub(super) fn set_in(
        &self,
        data: &mut CudaSlice<f32>,
        cols: usize,
        places: &[(u32, u32)],
        value: f32,
        values: Option<&[f32]>,
    ) -> Result<()> {
        if places.is_empty() {
            return Ok(());
        }
        let f = self.function(Kernel::Layers(DType::F32, "set_logits"))?;
        let (flat, n, cols) = self.places("set_logits", cols, places)?;
        let values = values.map(|v| self.upload(v)).transpose()?;
        let no_values = 0u64;
        let mut b = self.stream.launch_builder(&f);
        b.arg(data).arg(&flat).arg(&n).arg(&cols).arg(&value);
        match &values {
            Some(v) => b.arg(v),
            None => b.arg(&no_values),
        };
        // SAFETY: each place is a (row, token) inside data (rows × cols, checked by the
        // caller), and values, where given, hold one float a place.
        unsafe { b.launch(self.elementwise(places.len())) }.ctx("launching set_logits")?;
        Ok(())
    }

    /// `(row, token)` places uploaded as pairs, with their count and the logits' `cols` as a
    /// kernel takes them.
    fn places(
        &self,
        op: &'static str,
        cols: usize,
        places: &[(u32, u32)],
    ) -> Result<(CudaSlice<u32>, u32, u32)> {
        let flat: Vec<u32> = places.iter().flat_map(|&(r, t)| [r, t]).collect();
        Ok((
            self.upload(&flat)?,
            narrow(op, places.len())?,
            narrow(op, cols)?,
        ))
    }

    /// `layers.cu`'s `kernel`, one CTA a row of `logits`, each reading its own entry of
    /// `per_row` and writing its row of `out`.
    fn row_reduction<T: cudarc::driver::DeviceRepr>(
        &self,
        kernel: &'static str,
        logits: &CudaTensor,
        per_row: &[T],
        out: &mut CudaTensor,
    ) -> Result<()> {
        out.drop_rounded();
        if logits.rows == 0 {
            return Ok(());
        }
        let f = self.function(Kernel::Layers(DType::F32, kernel))?;
        let s = &self.stream;
        let per_row = self.upload(per_row)?;
        let params = Params::default()
            .buffer(&logits.data, s)
            .buffer(&per_row, s)
            .u32(narrow(kernel, logits.cols)?)
            .buffer(&out.data, s);
        let cfg = LaunchConfig {
            grid_dim: (narrow(kernel, logits.rows)?, 1, 1),
            block_dim: (LAYER_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: CTA `row` reads row `row` of logits (rows × cols, and for `logprob_terms`
        // the logit of a target below cols, checked by the caller) and entry `row` of
        // per_row (rows long), and writes its own row of out (rows × 2 or rows × 1).
        unsafe { self.launch_dependent(&f, cfg, &params) }.ctx(format!("launching {kernel}"))
    }

    /// Each row of `logits` narrowed to its `k` most likely tokens in `out` (`rows × 2k`; the
    /// caller checked both shapes and `k`).
    pub(super) fn top_rows(
        &self,
        logits: &CudaTensor,
        k: usize,
        out: &mut CudaTensor,
    ) -> Result<()> {
        if 2 * k > SEGMENT || logits.rows > MOST_ROWS {
            return Err(CudaError::Unsupported(format!(
                "top_logits: {} rows narrowed to {k} each is past the kernel's {MOST_ROWS} rows or {} tokens",
                logits.rows,
                SEGMENT / 2
            )));
        }
        out.drop_rounded();
        if logits.rows == 0 {
            return Ok(());
        }
        let f = self.function(Kernel::Layers(DType::F32, "top_logits"))?;
        let s = &self.stream;
        let rows = narrow("top_logits", logits.rows)?;
        let k32 = narrow("top_logits", k)?;
        let mut n = logits.cols;
        let mut keys_in: Option<CudaSlice<u64>> = None;
        loop {
            let segments = n.div_ceil(SEGMENT);
            let keys_out = match segments {
                1 => None,
                _ => Some(self.alloc::<u64>(logits.rows * segments * k)?),
            };
            // A pointer a pass neither reads nor writes is given the logits' address.
            let params = Params::default().buffer(&logits.data, s);
            let params = match &keys_in {
                Some(keys) => params.buffer(keys, s),
                None => params.buffer(&logits.data, s),
            }
            .u32(narrow("top_logits", n)?)
            .u32(u32::from(keys_in.is_none()))
            .u32(k32);
            let params = match &keys_out {
                Some(keys) => params.buffer(keys, s),
                None => params.buffer(&logits.data, s),
            }
            .buffer(&out.data, s);
            let cfg = LaunchConfig {
                grid_dim: (narrow("top_logits", segments)?, rows, 1),
                block_dim: (LAYER_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: CTA (segment, row) reads entries of row `row` below `n` (the logits are
            // rows × n on the first pass, the keys rows × n after), writes k keys at its
            // segment of rows × segments × k, or on the last pass 2k floats of row `row` of
            // out (rows × 2k, checked by the caller).
            unsafe { self.launch_dependent(&f, cfg, &params) }.ctx("launching top_logits")?;
            if keys_out.is_none() {
                return Ok(());
            }
            n = segments * k;
            keys_in = keys_out;
        }
    }
}
