//! Attention of a block of query rows over a block of keys (`causal_attention` in
//! `layers.cu`), merged into the rows' states: what a prompt's chunks run at prefill, each
//! rank's block and the blocks that arrive from other ranks, in any order. Also the empty
//! states those blocks merge into.

use super::{narrow, same_dims, CudaTensor};
use crate::backend::{CudaBackend, CudaStates};
use crate::error::{CudaError, DriverContext, Result};
use canopy_core::{AttnShape, DType};
use canopy_engine::layer_ops::expect_size;
use canopy_engine::Backend;
use canopy_kernels::{Kernel, ATTENTION_MAX_HEAD_DIM, CAUSAL_ROWS, LAYER_THREADS};
use cudarc::driver::{DevicePtrMut, LaunchConfig, PushKernelArg};

/// Whether `causal_attention` holds heads of `head_dim` (whole warps of lanes, in registers).
pub(super) fn holds(head_dim: usize) -> bool {
    head_dim > 0 && head_dim.is_multiple_of(32) && head_dim <= ATTENTION_MAX_HEAD_DIM
}

/// A shape the attention kernel runs: whole GQA groups, a head dim it holds.
fn check_attention_shape(op: &str, shape: &AttnShape) -> Result<()> {
    if shape.kv_heads == 0 || !shape.q_heads.is_multiple_of(shape.kv_heads) {
        return Err(CudaError::Unsupported(format!(
            "{op}: {} query heads cannot share {} KV heads evenly",
            shape.q_heads, shape.kv_heads
        )));
    }
    if !holds(shape.head_dim) {
        return Err(CudaError::Unsupported(format!(
            "{op}: head dim {} is not a multiple of 32 up to {ATTENTION_MAX_HEAD_DIM}",
            shape.head_dim
        )));
    }
    Ok(())
}

impl CudaBackend {
    /// `rows` empty states (`o = 0`, `lse = -inf`): the merge's identity, which the first
    /// block to reach a row replaces as it is.
    pub(super) fn empty(&self, shape: &AttnShape, rows: usize) -> Result<CudaStates> {
        let mut states = Backend::alloc_states(self, shape, rows)?;
        let s = &self.stream;
        s.memset_zeros(&mut states.o).ctx("cuMemsetD8Async")?;
        let n = states.lse.len();
        let (lse, _) = states.lse.device_ptr_mut(s);
        // SAFETY: writes the lse buffer's n floats with -inf's bits.
        unsafe {
            cudarc::driver::sys::cuMemsetD32Async(
                lse,
                f32::NEG_INFINITY.to_bits(),
                n,
                s.cu_stream(),
            )
        }
        .result()
        .ctx("cuMemsetD32Async")?;
        Ok(states)
    }

    /// One block of keys merged into `states`, one warp per (row, head) (`layers.cu` says
    /// how). The scale is the shape's (`1/sqrt(head_dim)` unless it sets one).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attend_block(
        &self,
        shape: &AttnShape,
        q: &CudaTensor,
        q_pos: &[u32],
        k: &CudaTensor,
        v: &CudaTensor,
        k_pos: &[u32],
        states: &mut CudaStates,
    ) -> Result<()> {
        let op = "causal_attention";
        check_attention_shape(op, shape)?;
        same_dims(op, "q", q, (q_pos.len(), shape.q_row_elems()))?;
        same_dims(op, "k", k, (k_pos.len(), shape.kv_token_elems()))?;
        same_dims(op, "v", v, (k_pos.len(), shape.kv_token_elems()))?;
        expect_size("cuda", op, "the states' rows", states.rows, q.rows)?;
        expect_size("cuda", op, "the states' heads", states.heads, shape.q_heads)?;
        expect_size(
            "cuda",
            op,
            "the states' head dim",
            states.head_dim,
            shape.head_dim,
        )?;
        if q.rows == 0 || k.rows == 0 {
            return Ok(());
        }
        let rows = narrow(op, q.rows)?;
        let tokens = narrow(op, k.rows)?;
        let (q_heads, kv_heads, head_dim) = (
            narrow(op, shape.q_heads)?,
            narrow(op, shape.kv_heads)?,
            narrow(op, shape.head_dim)?,
        );
        let scale = shape.softmax_scale();
        let q_pos = self.upload(q_pos)?;
        let k_pos = self.upload(k_pos)?;
        let f = self.function(Kernel::Layers(DType::F32, "causal_attention"))?;
        let warps = LAYER_THREADS as usize / 32;
        let cfg = LaunchConfig {
            grid_dim: (
                narrow(
                    op,
                    (q.rows.div_ceil(CAUSAL_ROWS) * shape.q_heads).div_ceil(warps),
                )?,
                1,
                1,
            ),
            block_dim: (LAYER_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream.launch_builder(&f);
        b.arg(&q.data)
            .arg(&q_pos)
            .arg(&k.data)
            .arg(&v.data)
            .arg(&k_pos)
            .arg(&tokens)
            .arg(&mut states.o)
            .arg(&mut states.lse)
            .arg(&rows)
            .arg(&q_heads)
            .arg(&kv_heads)
            .arg(&head_dim)
            .arg(&scale);
        // SAFETY: one warp per CAUSAL_ROWS rows of a head, rows below `rows`; q and the states hold
        // those cells of head_dim floats (and one lse each), k and v `tokens` rows of kv_heads
        // heads, and the GQA ratio is whole (checked), so every index is within its buffer.
        unsafe { b.launch(cfg) }.ctx("launching causal_attention")?;
        Ok(())
    }
}
