//! RoPE on the CUDA backend: a fused q|k|v projection split into q, k and v with q and k
//! rotated (`rope_split`), the keys and values appended to the KV cache in the same kernel
//! (`rope_split_store`), and all of it as the epilogue of a decode step's q|k|v GEMV
//! (`gemv_rope`), which spares the step a launch and a kernel that waits on the GEMV.

use super::gemm::{gemv_fits, gemv_normalises, gemv_staged, Epilogue, GemvRows, StepInput};
use super::{narrow, same_dims, slot_pairs, CudaTensor, CudaWeight};
use crate::backend::CudaBackend;
use crate::error::{CudaError, DriverContext, Result};
use crate::kv::CudaKv;
use crate::launch::Params;
use canopy_core::DType;
use canopy_engine::layer_ops::expect_size;
use canopy_kernels::{Kernel, GEMV_COLS, GEMV_WARPS};
use cudarc::driver::{CudaSlice, DevicePtr, LaunchConfig};

impl CudaBackend {
    /// [`LayerOps::rope_split`], and with `store` the rotated keys and values of its rows
    /// written into their slots of the KV pool in the same kernel (`rope_split_store`).
    pub(crate) fn rope(
        &self,
        qkv: &CudaTensor,
        positions: &[u32],
        inv_freq: &CudaWeight,
        (q, k, v): (&mut CudaTensor, &mut CudaTensor, &mut CudaTensor),
        store: Option<(&mut CudaKv, &[(u32, u32)])>,
    ) -> Result<()> {
        expect_size(
            "cuda",
            "rope_split",
            "the width of qkv",
            qkv.cols,
            q.cols + 2 * k.cols,
        )?;
        let rows = qkv.rows;
        let half = self.check_rope(rows, positions, inv_freq, (q, k, v), &store)?;
        if rows == 0 {
            return Ok(());
        }
        let (rows_, q_cols, kv_cols, half_) = (
            narrow("rope_split", rows)?,
            narrow("rope_split", q.cols)?,
            narrow("rope_split", k.cols)?,
            narrow("rope_split", half)?,
        );
        let positions = self.upload_step_input(StepInput::Positions, positions)?;
        let s = &self.stream;
        let values = qkv.values("rope_split")?;
        // 16-byte loads and stores need every row they touch on 16 bytes: the activations',
        // and the pool's where an fp32 pool takes the stored keys and values whole.
        let mut addresses = vec![
            values.device_ptr(s).0,
            q.data.device_ptr(s).0,
            k.data.device_ptr(s).0,
            v.data.device_ptr(s).0,
        ];
        if let Some((kv, _)) = &store {
            addresses.extend([kv.k.device_ptr(s).0, kv.v.device_ptr(s).0]);
        }
        let aligned = addresses.iter().all(|a| a.is_multiple_of(16));
        let vec = if aligned && half.is_multiple_of(4) {
            4
        } else {
            1
        };
        let lanes = |rows: usize| rows * (half / vec);
        let threads = self.elementwise_threads();
        let (heads, kv_heads) = ((q.cols + k.cols) / (2 * half), k.cols / (2 * half));
        let chunk = head_chunk(lanes(rows), heads, threads);
        let params = Params::default()
            .buffer(values, s)
            .buffer(&*positions, s)
            .buffer(&inv_freq.data, s)
            .buffer(&q.data, s)
            .buffer(&k.data, s)
            .buffer(&v.data, s)
            .u32(rows_)
            .u32(q_cols)
            .u32(kv_cols)
            .u32(half_)
            .u32(u32::from(vec == 4))
            .u32(narrow("rope_split", chunk)?);
        // One item a thread where the grid holds them all: every kind of item at once.
        let mut items = lanes(rows) * heads.div_ceil(chunk) + rows * k.cols / vec;
        let (f, params) = match store {
            Some((kv, stores)) if !stores.is_empty() => {
                let count = narrow("rope_split_store", stores.len())?;
                let slots = self.upload_step_input(StepInput::Slots, &slot_pairs(stores))?;
                let store_chunk = head_chunk(lanes(stores.len()), kv_heads, threads);
                items += lanes(stores.len()) * kv_heads.div_ceil(store_chunk)
                    + stores.len() * k.cols / vec;
                let f = self.function(Kernel::Layers(kv.dtype, "rope_split_store"))?;
                let params = params
                    .buffer(&*slots, s)
                    .buffer(&kv.k, s)
                    .buffer(&kv.v, s)
                    .u32(count)
                    .u32(narrow("rope_split_store", store_chunk)?);
                (f, params)
            }
            _ => (
                self.function(Kernel::Layers(DType::F32, "rope_split"))?,
                params,
            ),
        };
        // SAFETY: qkv holds rows × (q_cols + 2 kv_cols) floats, q rows × q_cols, k and v rows ×
        // kv_cols (checked); one position per row and `half` f32 frequencies; every head
        // lies within q's or k's columns. Every stored row is one of qkv's and every slot one
        // of the pool's, whose K and V hold tokens of kv_cols elements (check_stores).
        unsafe { self.launch_dependent(&f, self.elementwise(items), &params) }
            .ctx("launching rope_split")?;
        Ok(())
    }

    /// Refuses RoPE outputs of other than `rows` rows, positions other than one a row,
    /// frequencies that are not f32 or do not cut q and k into whole heads, and stores outside
    /// k or the pool; returns the heads' half width. The outputs lose any rounded copy.
    fn check_rope(
        &self,
        rows: usize,
        positions: &[u32],
        inv_freq: &CudaWeight,
        (q, k, v): (&mut CudaTensor, &mut CudaTensor, &mut CudaTensor),
        store: &Option<(&mut CudaKv, &[(u32, u32)])>,
    ) -> Result<usize> {
        for t in [&mut *q, &mut *k, &mut *v] {
            t.drop_rounded();
        }
        same_dims("rope_split", "k", k, (rows, k.cols))?;
        same_dims("rope_split", "q", q, (rows, q.cols))?;
        same_dims("rope_split", "v", v, (rows, k.cols))?;
        expect_size(
            "cuda",
            "rope_split",
            "the number of positions",
            positions.len(),
            rows,
        )?;
        let half = inv_freq.rows * inv_freq.cols;
        if inv_freq.dtype != DType::F32
            || half == 0
            || !q.cols.is_multiple_of(2 * half)
            || !k.cols.is_multiple_of(2 * half)
        {
            return Err(CudaError::Unsupported(format!(
                "rope_split: rows of {} and {} values are not whole heads of {} (RoPE frequencies must be f32)",
                q.cols,
                k.cols,
                2 * half
            )));
        }
        if let Some((kv, pairs)) = store {
            self.check_stores(kv, k, pairs)?;
        }
        Ok(half)
    }

    /// Refuses a store of rows of `k` into `kv` whose width is not the KV's or whose rows or
    /// slots are outside `k` or the pool.
    pub(crate) fn check_stores(
        &self,
        kv: &CudaKv,
        k: &CudaTensor,
        rows: &[(u32, u32)],
    ) -> Result<()> {
        let width = kv.shape.kv_token_elems();
        expect_size("cuda", "store_kv", "the width of k", k.cols, width)?;
        let pool = kv.pool_tokens();
        if let Some(&(row, slot)) = rows
            .iter()
            .find(|&&(row, slot)| row as usize >= k.rows || slot as usize >= pool)
        {
            return Err(CudaError::Unsupported(format!(
                "store_kv: row {row} to slot {slot} is outside k's {} rows or the KV pool of {pool} tokens",
                k.rows
            )));
        }
        Ok(())
    }

    /// [`LayerOps::rms_norm_matmul_rope`](canopy_engine::LayerOps::rms_norm_matmul_rope):
    /// one `gemv_rope` launch where the GEMV takes the product in slices of at most 4 (its
    /// CTAs then hold both columns of every rotated pair), the heads are whole groups of its
    /// columns and the KV, if stored into, is of the weight's dtype; its rows normalised in
    /// the GEMV where `gemv_normed` would, else by `rms_norm` into `normed` first. Otherwise
    /// the product into `fused`, then RoPE.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn qkv_rope(
        &self,
        x: &CudaTensor,
        (norm, eps): (&CudaWeight, f32),
        w: &CudaWeight,
        (normed, fused): (&mut CudaTensor, &mut CudaTensor),
        positions: &[u32],
        inv_freq: &CudaWeight,
        (q, k, v): (&mut CudaTensor, &mut CudaTensor, &mut CudaTensor),
        store: Option<(&mut CudaKv, &[(u32, u32)])>,
    ) -> Result<()> {
        let (rows, half) = (x.rows, inv_freq.rows * inv_freq.cols);
        let cols = q.cols + 2 * k.cols;
        let in_gemv = gemv_normalises(x, norm, w);
        let kernel = Kernel::Layers(w.dtype, "gemv_rope");
        let shaped = rows > 0
            && w.rows == cols
            && w.cols == x.cols
            && gemv_fits(rows, x.cols, w)
            && half > 0
            && half.is_multiple_of(GEMV_COLS as usize)
            // The kernel stores keys and values in the weight's dtype.
            && store.as_ref().is_none_or(|(kv, _)| kv.dtype == w.dtype);
        let launch = if shaped {
            let f = self.function(kernel)?;
            let staged = gemv_staged(GemvRows::of(x)?, w, in_gemv)?;
            let groups = narrow("matmul", cols)?.div_ceil(GEMV_COLS);
            let slices = self.gemv_slices(kernel, &f, groups, staged)?;
            Some((f, slices, staged))
        } else {
            None
        };
        let Some((f, slices, staged)) = launch.filter(|&(_, slices, _)| slices <= 4) else {
            self.normed_product(x, (norm, eps), w, normed, fused, Epilogue::Store)?;
            return self.rope(fused, positions, inv_freq, (q, k, v), store);
        };
        let half = self.check_rope(rows, positions, inv_freq, (q, k, v), &store)?;
        let activation = if in_gemv {
            super::check_norm_weight(x, norm)?;
            x
        } else {
            self.rms_norm_rows(x, norm, eps, normed)?;
            &*normed
        };
        let positions = self.upload_step_input(StepInput::Positions, positions)?;
        let stores = store.as_ref().map_or(&[][..], |(_, pairs)| pairs);
        let slots = self.upload_step_input(StepInput::Slots, &slot_pairs(stores))?;
        let s = &self.stream;
        let null = None::<&CudaSlice<f32>>;
        let mut params = Params::default()
            .buffer(&w.data, s)
            .buffer(activation.values("matmul")?, s)
            .optional_buffer(in_gemv.then_some(&norm.data), s)
            .f32(eps)
            .u32(narrow("matmul", rows)?)
            .u32(narrow("matmul", x.cols)?)
            .u32(slices)
            .buffer(&*positions, s)
            .buffer(&inv_freq.data, s)
            .buffer(&q.data, s)
            .buffer(&k.data, s)
            .buffer(&v.data, s)
            .u32(narrow("rope_split", q.cols)?)
            .u32(narrow("rope_split", k.cols)?)
            .u32(narrow("rope_split", half)?)
            .buffer(&*slots, s);
        params = match store {
            Some((kv, pairs)) => params
                .buffer(&kv.k, s)
                .buffer(&kv.v, s)
                .u32(narrow("rope_split_store", pairs.len())?),
            None => params
                .optional_buffer(null, s)
                .optional_buffer(null, s)
                .u32(0),
        };
        let pairs = (cols / GEMV_COLS as usize).div_ceil(2);
        let cfg = LaunchConfig {
            grid_dim: (
                narrow(
                    "matmul",
                    pairs.div_ceil(GEMV_WARPS as usize / slices as usize / 2),
                )?,
                1,
                1,
            ),
            block_dim: (GEMV_WARPS * 32, 1, 1),
            shared_mem_bytes: staged,
        };
        // SAFETY: w holds cols × k elements of its dtype and the activation rows × k floats (or
        // their normalised copy is staged, the norm's weight k elements of w's dtype), at most
        // GEMV_MAX_ROWS rows (gemv_fits) and k a whole number of 16-byte chunks; q, k and v
        // hold rows × their columns, whole heads of 2 · half columns, half a whole number of
        // GEMV_COLS (checked), one position a row and half f32 frequencies; every stored row
        // is one of theirs and every slot one of the pool's (check_stores). Slices of at most
        // 4 give every CTA whole pairs of groups; the grid covers every pair.
        unsafe { self.launch_params(&f, cfg, &params, false) }.ctx("launching gemv_rope")?;
        Ok(())
    }
}

/// Heads a RoPE kernel's item rotates with one set of angles: few enough that `lanes` (rows ×
/// pair groups) times the chunks fill `threads`, an element-wise grid's threads, so the
/// loads in flight keep the memory busy (rounded down: the last chunk may be short); all of
/// them where the rows alone fill it.
fn head_chunk(lanes: usize, heads: usize, threads: usize) -> usize {
    let heads = heads.max(1);
    let chunks = threads.div_ceil(lanes.max(1)).clamp(1, heads);
    heads / chunks
}

#[cfg(test)]
mod tests {
    use super::head_chunk;

    #[test]
    fn a_prefill_chunk_shares_angles_over_many_heads_and_a_few_rows_take_one_head_an_item() {
        let threads = 132 * 8 * 256;
        // 8,192 rows of 16 groups of 4 pairs, 40 q and k heads: chunks of 13, 13, 13 and 1.
        assert_eq!(head_chunk(8192 * 16, 40, threads), 13);
        // A decode step's 64 rows: one head an item, 40,960 items.
        assert_eq!(head_chunk(64 * 16, 40, threads), 1);
        // Rows enough to fill the grid alone: every head in one item.
        assert_eq!(head_chunk(threads, 40, threads), 40);
        assert_eq!(head_chunk(0, 0, threads), 1);
    }

    #[test]
    fn the_chunks_cover_the_heads_and_fill_the_grid_where_the_heads_allow() {
        let threads = 1000;
        for lanes in [1, 7, 100, 999, 1000, 5000] {
            for heads in 1..50 {
                let chunk = head_chunk(lanes, heads, threads);
                let chunks = heads.div_ceil(chunk);
                assert!((1..=heads).contains(&chunk));
                assert!(chunks * chunk >= heads);
                assert!(lanes * chunks >= threads || chunks == heads);
            }
        }
    }
}
