//! An attention's states as the activation the output projection reads: fp32 values, or,
//! where that product runs on cuBLAS with a 16-bit weight, only their rounded copy
//! ([`LayerOps::gemm_operand`](canopy_engine::LayerOps::gemm_operand)). The kernel that
//! finishes the states writes that copy itself where it can (the merge of a rank's partials,
//! or of a prompt chunk's two blocks of keys), so that no kernel of its own rounds them.

use super::gemm::StepInput;
use super::{narrow, same_dims, CudaTensor};
use crate::backend::{CudaBackend, CudaQueries, CudaStates, EResult};
use crate::descriptors::CudaPlan;
use crate::error::{DriverContext, Result};
use crate::kv::CudaKv;
use canopy_core::DType;
use canopy_engine::layer_ops::expect_states_gather;
use canopy_engine::{Backend, MergeOps};
use canopy_kernels::Kernel;
use cudarc::driver::{CudaSlice, PushKernelArg};

/// The most runs of rows a gather copies one by one; more take one kernel launch.
const COPIES_AT_MOST: usize = 4;

impl CudaBackend {
    /// Row `rows[i]` of `src` (`cols` values a row) into row `i` of `dst`: one copy per run of
    /// consecutive rows, or, where the rows run in more pieces than [`COPIES_AT_MOST`], one
    /// `gather_rows` launch (`combine.cu`) reading them as `input` (a recording takes the
    /// copies: it stages no such input).
    pub(super) fn copy_row_runs(
        &self,
        src: &CudaSlice<f32>,
        dst: &mut CudaSlice<f32>,
        rows: &[usize],
        cols: usize,
        input: StepInput,
    ) -> Result<()> {
        let runs = 1 + rows.windows(2).filter(|w| w[1] != w[0] + 1).count();
        if rows.is_empty() || cols == 0 {
            return Ok(());
        }
        if runs > COPIES_AT_MOST && !self.capturing() {
            let (count, width) = (
                narrow("gather_rows", rows.len())?,
                narrow("gather_rows", cols)?,
            );
            let picks: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
            let picks = self.upload_step_input(input, &picks)?;
            let f = self.function(Kernel::Combine("gather_rows"))?;
            let mut b = self.stream.launch_builder(&f);
            b.arg(src).arg(&*picks).arg(&count).arg(&width).arg(dst);
            // SAFETY: every row is below the source's rows (the caller checked), and `dst`
            // holds count × cols values.
            unsafe { b.launch(self.elementwise(rows.len() * cols)) }
                .ctx("launching gather_rows")?;
            return Ok(());
        }
        let mut at = 0;
        while at < rows.len() {
            let run = 1
                + (rows[at + 1..].iter().zip(&rows[at..]))
                    .take_while(|(next, prev)| **next == **prev + 1)
                    .count();
            let (from, to, n) = (rows[at] * cols, at * cols, run * cols);
            self.stream
                .memcpy_dtod(&src.slice(from..from + n), &mut dst.slice_mut(to..to + n))
                .ctx("cuMemcpyDtoDAsync")?;
            at += run;
        }
        Ok(())
    }

    /// [`LayerOps::gather_states`](canopy_engine::LayerOps::gather_states).
    pub(super) fn gather_state_rows(
        &self,
        src: &CudaStates,
        rows: &[usize],
        out: &mut CudaStates,
    ) -> EResult<()> {
        let (heads, d) = (src.heads, src.head_dim);
        let dims = |s: &CudaStates| (s.rows, s.heads, s.head_dim);
        expect_states_gather("cuda", rows, dims(src), dims(out))?;
        self.copy_row_runs(&src.o, &mut out.o, rows, heads * d, StepInput::StateRows)?;
        Ok(self.copy_row_runs(&src.lse, &mut out.lse, rows, heads, StepInput::StateRows)?)
    }

    /// [`LayerOps::states_output`](canopy_engine::LayerOps::states_output): a copy of the
    /// states' outputs, or their rounded copy alone where `out` is a 16-bit operand.
    pub(super) fn output_of_states(&self, states: &CudaStates, out: &mut CudaTensor) -> Result<()> {
        let cols = states.heads * states.head_dim;
        same_dims("states_output", "the output", out, (states.rows, cols))?;
        let n = states.rows * cols;
        let dtype = out.operand.unwrap_or(DType::F32);
        let rounded = self.rounded_target(out, dtype)?;
        if n == 0 {
            return Ok(());
        }
        let Some(mut buf) = rounded else {
            self.stream
                .memcpy_dtod(&states.o.slice(..n), &mut out.data.slice_mut(..n))
                .ctx("cuMemcpyDtoDAsync")?;
            return Ok(());
        };
        // The rounded copy alone: it is all the output projection reads.
        let f = self.function(Kernel::Layers(dtype, "round_to_elem"))?;
        let (len, no_copy) = (n as u64, 0u64);
        let mut b = self.stream.launch_builder(&f);
        b.arg(&states.o).arg(&no_copy).arg(&mut buf).arg(&len);
        // SAFETY: the states' o and the rounded copy each hold n elements (checked).
        unsafe { b.launch(self.elementwise(n)) }.ctx("launching round_to_elem")?;
        out.rounded = Some(buf);
        Ok(())
    }

    /// [`LayerOps::step_output`](canopy_engine::LayerOps::step_output): the merge rounds the
    /// outputs into `out` where it is a 16-bit operand. A plan without a merge (stage 1 writes
    /// the output) leaves `out` to the caller.
    pub(super) fn step_into_output(
        &self,
        kv: &CudaKv,
        q: &CudaQueries,
        plan: &CudaPlan,
        partials: &mut CudaStates,
        states: &mut CudaStates,
        out: &mut CudaTensor,
    ) -> EResult<bool> {
        // A plan without a merge has stage 1 write the states: no kernel of it rounds them.
        let rounded = if plan.direct {
            None
        } else {
            self.rounded_copy(out, states)?
        };
        let Some((buf, dtype)) = rounded else {
            self.step(kv, q, plan, partials, states)?;
            return Ok(false);
        };
        self.run_plan(kv, q, plan, partials)?;
        self.merge_rounded(partials, plan, states, Some((&buf, dtype)))?;
        out.rounded = Some(buf);
        Ok(true)
    }

    /// [`LayerOps::merge_into_output`](canopy_engine::LayerOps::merge_into_output): the merge
    /// rounds the outputs into `out` where it is a 16-bit operand.
    pub(super) fn merge_pair_into_output(
        &self,
        acc: &mut CudaStates,
        x: &CudaStates,
        out: &mut CudaTensor,
    ) -> EResult<bool> {
        let Some((buf, dtype)) = self.rounded_copy(out, acc)? else {
            self.merge_into(acc, x)?;
            return Ok(false);
        };
        self.combine_pair(acc, x, Some((&buf, dtype)))?;
        out.rounded = Some(buf);
        Ok(true)
    }

    /// The buffer of `out`'s rounded copy and its dtype, where `out` is a 16-bit operand of
    /// `states`' shape, so that the kernel finishing `states` writes it: taken from `out`,
    /// which the caller gives it back once that kernel is queued.
    fn rounded_copy(
        &self,
        out: &mut CudaTensor,
        states: &CudaStates,
    ) -> Result<Option<(CudaSlice<u16>, DType)>> {
        let shape = (states.rows, states.heads * states.head_dim);
        let dtype = match out.operand {
            Some(d) if d != DType::F32 && (out.rows, out.cols) == shape => d,
            _ => return Ok(None),
        };
        Ok(self.rounded_target(out, dtype)?.map(|buf| (buf, dtype)))
    }
}
