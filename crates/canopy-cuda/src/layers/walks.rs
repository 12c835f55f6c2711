//! [`LayerOps::walk_tails`](canopy_engine::LayerOps::walk_tails) on the GPU: `walks.cu` walks
//! the rest of each draw past its row's likeliest tokens, a walk's row spread over CTAs of
//! `WALK_CHUNK` tokens, so that a step that walks one row waits about as long as one that walks
//! 64. A `top_p` cut first sums its tokens' masses into bins by depth below the row's top
//! (`walk_masses`), gathers the tokens of the bin where the cut falls (`walk_gather`) and selects
//! the last kept one among them (`walk_select`, which also walks the head); then every walk sums
//! what it passes chunk by chunk (`walk_sums`) and lands (`walk_land`). Where any walk reads
//! changed logits, every walk walks a copy of its row with its changes in place.

use super::{narrow, CudaTensor};
use crate::backend::CudaBackend;
use crate::error::{DriverContext, Result};
use canopy_core::logits::{TailCut, TailWalk};
use canopy_core::DType;
use canopy_kernels::{Kernel, WALK_BINS, WALK_CHUNK, WALK_THREADS};
use cudarc::driver::{
    CudaFunction, CudaSlice, DeviceRepr, LaunchArgs, LaunchConfig, PushKernelArg,
};

/// `walks.cu`'s `WalkState`, in 8-byte words: what `walk_select` leaves a cut walk.
const STATE_WORDS: usize = 4;

/// Words of a walk's entry in `walks.cu`'s index: its row, where its head tokens start in the
/// index and how many, whether top_p cuts it, and the model's row.
const WALK_INDEX: usize = 5;

/// A walk's parameters in `walks.cu`: the row's top logit, the temperature, the total and the
/// target, then its cut's uniform number, `top_p` and head mass.
const WALK_PARAMS: usize = 7;

/// What every walk kernel reads first: the walked rows (the logits, or copies of the walks'
/// rows with their changed logits), the model's logits, and the walks' index (their entries,
/// then their head tokens) and parameters.
struct WalkInputs<'a> {
    walked: &'a CudaSlice<f32>,
    model: &'a CudaSlice<f32>,
    cols: u32,
    index: CudaSlice<u32>,
    params: CudaSlice<f64>,
}

/// The walks' device buffers, kept between steps and grown as a step needs: a cut walk's
/// masses and gathered tokens come to megabytes a row, and memory made anew each step cost the
/// host more than the walks cost the device.
#[derive(Default)]
pub(crate) struct WalkScratch {
    states: Option<CudaSlice<u64>>,
    masses: Option<CudaSlice<u64>>,
    bins: Option<CudaSlice<u64>>,
    gathered: Option<CudaSlice<u32>>,
    counts: Option<CudaSlice<u32>>,
    sums: Option<CudaSlice<f64>>,
    lasts: Option<CudaSlice<i32>>,
}

impl CudaBackend {
    /// `slot`'s buffer, made anew where it holds fewer than `len` elements. Recorded passes
    /// never read the walks' buffers, so a new one leaves them valid.
    fn kept<'a, T: DeviceRepr>(
        &self,
        slot: &'a mut Option<CudaSlice<T>>,
        len: usize,
    ) -> Result<&'a mut CudaSlice<T>> {
        if slot.as_ref().is_none_or(|b| b.len() < len) {
            *slot = None;
            *slot = Some(self.alloc::<T>(len)?);
        }
        Ok(slot.as_mut().expect("made above"))
    }

    /// Where each walk lands into `out` (`walks × 2`; the caller checked the walks and the
    /// shape).
    pub(super) fn walk_rows(
        &self,
        logits: &CudaTensor,
        walks: &[(usize, &TailWalk)],
        out: &mut CudaTensor,
    ) -> Result<()> {
        out.drop_rounded();
        if walks.is_empty() {
            return Ok(());
        }
        let cols = logits.cols;
        let copies = self.changed_rows(logits, walks)?;
        // Each walk's index entry, then every walk's head tokens after them, in one upload.
        let head_tokens: usize = walks.iter().map(|(_, walk)| walk.head.len()).sum();
        let mut words = Vec::with_capacity(WALK_INDEX * walks.len() + head_tokens);
        let mut heads = Vec::with_capacity(head_tokens);
        let mut params = Vec::with_capacity(WALK_PARAMS * walks.len());
        for (w, &(row, walk)) in walks.iter().enumerate() {
            words.extend([
                narrow("walk_tails", if copies.is_some() { w } else { row })?,
                narrow("walk_tails", WALK_INDEX * walks.len() + heads.len())?,
                narrow("walk_tails", walk.head.len())?,
                u32::from(walk.cut.is_some()),
                narrow("walk_tails", row)?,
            ]);
            heads.extend_from_slice(&walk.head);
            let cut = walk.cut.unwrap_or(TailCut {
                u: 0.0,
                top_p: 1.0,
                head_mass: 0.0,
            });
            params.extend([
                f64::from(walk.max),
                f64::from(walk.temperature),
                walk.total,
                walk.target,
                cut.u,
                cut.top_p,
                cut.head_mass,
            ]);
        }
        words.extend(heads);
        let inputs = WalkInputs {
            walked: copies.as_ref().unwrap_or(&logits.data),
            model: &logits.data,
            cols: narrow("walk_tails", cols)?,
            index: self.upload(&words)?,
            params: self.upload(&params)?,
        };
        let n = narrow("walk_tails", walks.len())?;
        let chunks = cols.div_ceil(WALK_CHUNK);
        let spread = (narrow("walk_tails", chunks)?, n, 1);
        let one_a_walk = (n, 1, 1);
        // What walk_select leaves each cut walk (one entry where none cuts).
        let cuts = walks.iter().any(|(_, walk)| walk.cut.is_some());
        let mut scratch = self.walk_scratch.lock().unwrap_or_else(|e| e.into_inner());
        let scratch = &mut *scratch;
        let states = self.kept(&mut scratch.states, walks.len() * STATE_WORDS)?;
        if cuts {
            let masses = self.kept(&mut scratch.masses, walks.len() * cols)?;
            let bins = self.kept(&mut scratch.bins, walks.len() * WALK_BINS)?;
            (self.stream)
                .memset_zeros(&mut bins.slice_mut(..walks.len() * WALK_BINS))
                .ctx("cuMemsetD8Async")?;
            let gathered = self.kept(&mut scratch.gathered, walks.len() * cols)?;
            let counts = self.kept(&mut scratch.counts, walks.len() * chunks)?;
            // The three launches: CTA (c, w) or w reads row index[5w] of the walked
            // rows (logits, rows × cols, checked by the caller, or their copies, walks × cols),
            // a logit of row index[5w + 4] of logits, its head tokens (inside the index, each
            // below cols) and its params; it writes walk w's masses (walks × cols), bins (walks ×
            // WALK_BINS), gathered tokens (walks × cols, chunk c's from c · WALK_CHUNK), counts
            // (walks × chunks) and state (walks × STATE_WORDS words), held at least as long.
            let f = self.function(Kernel::Layers(DType::F32, "walk_masses"))?;
            let mut b = self.walk_args(&f, &inputs);
            b.arg(&mut *masses).arg(&mut *bins);
            // SAFETY: as the note above says.
            unsafe { b.launch(walk_config(spread)) }.ctx("launching walk_masses")?;
            let f = self.function(Kernel::Layers(DType::F32, "walk_gather"))?;
            let mut b = self.walk_args(&f, &inputs);
            b.arg(&*masses)
                .arg(&*bins)
                .arg(&mut *gathered)
                .arg(&mut *counts);
            // SAFETY: as the note above says.
            unsafe { b.launch(walk_config(spread)) }.ctx("launching walk_gather")?;
            let f = self.function(Kernel::Layers(DType::F32, "walk_select"))?;
            let mut b = self.walk_args(&f, &inputs);
            (b.arg(&*masses).arg(&*bins).arg(&*gathered))
                .arg(&mut *counts)
                .arg(&mut *states);
            // SAFETY: as the note above says.
            unsafe { b.launch(walk_config(one_a_walk)) }.ctx("launching walk_select")?;
        }
        let sums = self.kept(&mut scratch.sums, walks.len() * chunks)?;
        let lasts = self.kept(&mut scratch.lasts, walks.len() * chunks)?;
        // Both launches: as above; walk_sums writes chunk c of walk w's sums and lasts
        // (walks × chunks), and walk_land 2 floats of out (walks × 2, checked by the caller).
        let f = self.function(Kernel::Layers(DType::F32, "walk_sums"))?;
        let mut b = self.walk_args(&f, &inputs);
        b.arg(&*states).arg(&mut *sums).arg(&mut *lasts);
        // SAFETY: as the note above says.
        unsafe { b.launch(walk_config(spread)) }.ctx("launching walk_sums")?;
        let f = self.function(Kernel::Layers(DType::F32, "walk_land"))?;
        let mut b = self.walk_args(&f, &inputs);
        b.arg(&*states).arg(&*sums).arg(&*lasts).arg(&mut out.data);
        // SAFETY: as the note above says.
        unsafe { b.launch(walk_config(one_a_walk)) }.ctx("launching walk_land")?;
        Ok(())
    }

    /// Copies of the walks' rows with their changed logits in place, one a walk, where any walk
    /// changes logits (None where none does).
    fn changed_rows(
        &self,
        logits: &CudaTensor,
        walks: &[(usize, &TailWalk)],
    ) -> Result<Option<CudaSlice<f32>>> {
        let cols = logits.cols;
        let changed: Vec<(u32, u32, f32)> = (walks.iter().enumerate())
            .flat_map(|(w, (_, walk))| walk.changed.iter().map(move |&(t, x)| (w as u32, t, x)))
            .collect();
        if changed.is_empty() {
            return Ok(None);
        }
        let mut copies = self.alloc::<f32>(walks.len() * cols)?;
        for (w, &(row, _)) in walks.iter().enumerate() {
            self.stream
                .memcpy_dtod(
                    &logits.data.slice(row * cols..(row + 1) * cols),
                    &mut copies.slice_mut(w * cols..(w + 1) * cols),
                )
                .ctx("cuMemcpyDtoDAsync")?;
        }
        let places: Vec<(u32, u32)> = changed.iter().map(|&(w, t, _)| (w, t)).collect();
        let values: Vec<f32> = changed.iter().map(|&(_, _, x)| x).collect();
        self.set_in(&mut copies, cols, &places, f32::NAN, Some(&values))?;
        Ok(Some(copies))
    }

    /// A launch of `f` (a `walks.cu` kernel) with the walks' inputs pushed, for the caller's
    /// own arguments to follow.
    fn walk_args<'a>(&'a self, f: &'a CudaFunction, inputs: &'a WalkInputs<'a>) -> LaunchArgs<'a> {
        let mut b = self.stream.launch_builder(f);
        b.arg(inputs.walked)
            .arg(inputs.model)
            .arg(&inputs.cols)
            .arg(&inputs.index)
            .arg(&inputs.params);
        b
    }
}

/// A launch of `walks.cu`'s CTAs of `WALK_THREADS` over `grid`.
fn walk_config(grid: (u32, u32, u32)) -> LaunchConfig {
    LaunchConfig {
        grid_dim: grid,
        block_dim: (WALK_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}
