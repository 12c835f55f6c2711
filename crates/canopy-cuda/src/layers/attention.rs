//! Attention of a block of query rows over a block of keys (`causal_attention` in
//! `layers.cu`), merged into the rows' states: what a prompt's chunks run at prefill, each
//! rank's block and the blocks that arrive from other ranks, in any order. Also the empty
//! states those blocks merge into.

use super::gemm::StepInput;
use super::{narrow, same_dims, CudaTensor};
use crate::backend::{CudaBackend, CudaStates};
use crate::error::{CudaError, DriverContext, Result};
use crate::kv::CudaKv;
use canopy_core::{AttnShape, DType};
use canopy_engine::layer_ops::expect_size;
use canopy_engine::Backend;
use canopy_engine::{CachedKeys, KeyBlock};
use canopy_kernels::{
    Kernel, PrefillLaunch, ATTENTION_MAX_HEAD_DIM, CAUSAL_ROWS, LAYER_THREADS, MMA_HEAD_DIMS,
    PREFILL_ROWS, PREFILL_TILE,
};
use cudarc::driver::{CudaSlice, DevicePtrMut, LaunchConfig, PushKernelArg};
use std::sync::Arc;

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

    /// One block of keys merged into `states`
    /// ([`LayerOps::causal_attention_from`](canopy_engine::LayerOps::causal_attention_from)):
    /// on tensor cores (`prefill.cu`) for KV of a 16-bit dtype and a head dim they hold, else
    /// one warp per [`CAUSAL_ROWS`] rows of a head (`layers.cu`), reading the keys rounded to
    /// their dtype. The scale is the shape's (`1/sqrt(head_dim)` unless it sets one).
    pub(super) fn attend_block(
        &self,
        shape: &AttnShape,
        q: &CudaTensor,
        q_pos: &[u32],
        q_from: Option<&[u32]>,
        keys: KeyBlock<'_, CudaTensor>,
        states: &mut CudaStates,
    ) -> Result<()> {
        let op = "causal_attention";
        let (k, v) = (keys.k, keys.v);
        check_attention_shape(op, shape)?;
        same_dims(op, "q", q, (q_pos.len(), shape.q_row_elems()))?;
        if let Some(from) = q_from {
            expect_size("cuda", op, "the query windows' starts", from.len(), q.rows)?;
        }
        same_dims(op, "k", k, (keys.positions.len(), shape.kv_token_elems()))?;
        same_dims(op, "v", v, (keys.positions.len(), shape.kv_token_elems()))?;
        check_states(op, shape, q, states)?;
        if q.rows == 0 || k.rows == 0 {
            return Ok(());
        }
        let block = Block {
            shape,
            q,
            q_pos: self.upload_step_input(StepInput::BlockPositions, q_pos)?,
            q_from: q_from
                .map(|from| self.upload_step_input(StepInput::BlockFrom, from))
                .transpose()?,
            keys,
            k_pos: self.upload_step_input(StepInput::KeyPositions, keys.positions)?,
            dims: Dims::of(op, shape, q.rows, k.rows)?,
        };
        if on_tensor_cores(shape, keys.dtype) {
            self.attend_on_tensor_cores(&block, states)
        } else {
            self.attend_on_cuda_cores(&block, states)
        }
    }

    /// `prefill.cu`: the keys packed to their dtype in whole tiles, then one CTA per block of
    /// [`PrefillLaunch::rows`] rows (queries × the GQA heads of one KV head).
    fn attend_on_tensor_cores(&self, block: &Block, states: &mut CudaStates) -> Result<()> {
        let (shape, keys, dims) = (block.shape, block.keys, block.dims);
        let mut packed = self.packed_keys(shape, keys.dtype, dims.tokens as usize)?;
        let rows = Packer::Rows {
            k: &keys.k.data,
            v: &keys.v.data,
        };
        // SAFETY: k and v hold `tokens` rows of kv_heads × head_dim floats each (checked).
        unsafe { self.launch_packer(rows, &block.k_pos, dims, &mut packed) }?;
        let rows = BlockRows {
            q: block.q,
            q_pos: &block.q_pos,
            q_from: block.q_from.as_deref(),
        };
        self.prefill_attention(
            shape,
            rows,
            &block.k_pos,
            dims,
            &packed,
            Results::States(states),
        )
    }

    /// [`LayerOps::cached_attention`](canopy_engine::LayerOps::cached_attention): for a KV
    /// of a 16-bit dtype and a shape the tensor cores hold, the keys are gathered from the
    /// cache straight into `prefill.cu`'s tiles (`gather_keys`); otherwise they are loaded as
    /// activations and attended as a block.
    pub(super) fn attend_cached(
        &self,
        shape: &AttnShape,
        q: &CudaTensor,
        q_pos: &[u32],
        keys: CachedKeys<'_, CudaKv>,
        states: &mut CudaStates,
    ) -> Result<()> {
        let op = "cached_attention";
        let CachedKeys {
            kv,
            slots,
            positions,
        } = keys;
        keys.check("cuda", op)?;
        if !gathers_on_tensor_cores(shape, kv) {
            let (k, v) = self.load_rows(kv, slots)?;
            let keys = KeyBlock {
                k: &k,
                v: &v,
                positions,
                dtype: kv.dtype,
            };
            return self.attend_block(shape, q, q_pos, None, keys, states);
        }
        check_states(op, shape, q, states)?;
        self.gather_and_attend(shape, q, q_pos, keys, Results::States(states))
    }

    /// [`LayerOps::cached_attention_output`](canopy_engine::LayerOps::cached_attention_output)
    /// where `prefill_attention` stores the output itself: the tensor cores hold the shape
    /// and `out` is an operand of the KV's dtype. Returns false, having done nothing, where
    /// they do not.
    pub(super) fn attend_cached_into(
        &self,
        shape: &AttnShape,
        q: &CudaTensor,
        q_pos: &[u32],
        keys: CachedKeys<'_, CudaKv>,
        out: &mut CudaTensor,
    ) -> Result<bool> {
        let op = "cached_attention_output";
        let kv = keys.kv;
        if !gathers_on_tensor_cores(shape, kv) || out.operand != Some(kv.dtype) {
            return Ok(false);
        }
        keys.check("cuda", op)?;
        same_dims(op, "the output", out, (q.rows, shape.q_row_elems()))?;
        let Some(mut rounded) = self.rounded_target(out, kv.dtype)? else {
            return Ok(false);
        };
        if keys.slots.is_empty() {
            // No key: the output of empty states.
            self.stream
                .memset_zeros(&mut rounded)
                .ctx("cuMemsetD8Async")?;
        } else {
            self.gather_and_attend(shape, q, q_pos, keys, Results::Output(&mut rounded))?;
        }
        out.rounded = Some(rounded);
        Ok(true)
    }

    /// The keys at `keys.slots` of their cache (a 16-bit dtype, a shape the tensor cores hold)
    /// gathered into `prefill.cu`'s tiles, and `q` attended to them.
    fn gather_and_attend(
        &self,
        shape: &AttnShape,
        q: &CudaTensor,
        q_pos: &[u32],
        keys: CachedKeys<'_, CudaKv>,
        results: Results,
    ) -> Result<()> {
        let op = "cached_attention";
        let CachedKeys {
            kv,
            slots,
            positions,
        } = keys;
        check_attention_shape(op, shape)?;
        same_dims(op, "q", q, (q_pos.len(), shape.q_row_elems()))?;
        kv.check_slots(op, slots)?;
        if q.rows == 0 || slots.is_empty() {
            return Ok(());
        }
        let dims = Dims::of(op, shape, q.rows, slots.len())?;
        // Every layer of a prefill pass reads the same keys: uploaded once a pass.
        let mut packed = self.packed_keys(shape, kv.dtype, slots.len())?;
        // The step input buffers may be longer than their contents: their lengths are not read.
        let (q_pos, k_pos, slots) = (
            self.upload_step_input(StepInput::Positions, q_pos)?,
            self.upload_step_input(StepInput::KeyPositions, positions)?,
            self.upload_step_input(StepInput::KeySlots, slots)?,
        );
        let cache = Packer::Cache {
            k: &kv.k,
            v: &kv.v,
            slots: &slots,
        };
        // SAFETY: the pool's K and V hold `pool` tokens of kv_heads × head_dim 16-bit elements
        // (the shape is the pool's), and each of the `tokens` slots is one of them (checked).
        unsafe { self.launch_packer(cache, &k_pos, dims, &mut packed) }?;
        let rows = BlockRows {
            q,
            q_pos: &q_pos,
            q_from: None,
        };
        self.prefill_attention(shape, rows, &k_pos, dims, &packed, results)
    }

    /// Keys and values of `tokens` tokens of `dtype` in `prefill.cu`'s tiles, and the tiles'
    /// bounds.
    fn packed_keys(&self, shape: &AttnShape, dtype: DType, tokens: usize) -> Result<PackedKeys> {
        let tiles = tokens.div_ceil(PREFILL_TILE);
        let len = shape.kv_heads * tiles * PREFILL_TILE * shape.head_dim;
        Ok(PackedKeys {
            dtype,
            tiles: narrow("causal_attention", tiles)?,
            k: self.alloc::<u16>(len)?,
            v: self.alloc::<u16>(len)?,
            bounds: self.alloc::<u32>(2 * tiles)?,
        })
    }

    /// Launches `prefill.cu`'s packer of `source` into `packed`, one CTA per tile.
    ///
    /// # Safety
    /// `source` must hold `dims.tokens` keys of the shape `packed` was sized for (a cache's
    /// slots, each one of its pool's), and `k_pos` their positions.
    unsafe fn launch_packer(
        &self,
        source: Packer,
        k_pos: &CudaSlice<u32>,
        dims: Dims,
        packed: &mut PackedKeys,
    ) -> Result<()> {
        let entry = match source {
            Packer::Rows { .. } => "pack_keys",
            Packer::Cache { .. } => "gather_keys",
        };
        let f = self.function(Kernel::Prefill {
            dtype: packed.dtype,
            head_dim: dims.head_dim as usize,
            entry,
        })?;
        let kv_heads = dims.kv_heads as i32;
        let cfg = packed.launch(dims.kv_heads);
        let mut b = self.stream.launch_builder(&f);
        match source {
            Packer::Rows { k, v } => b.arg(k).arg(v),
            Packer::Cache { k, v, slots } => b.arg(k).arg(v).arg(slots),
        };
        b.arg(k_pos)
            .arg(&dims.tokens)
            .arg(&kv_heads)
            .arg(&mut packed.k)
            .arg(&mut packed.v)
            .arg(&mut packed.bounds);
        // SAFETY: the source holds `tokens` keys (the caller's promise), k_pos their
        // positions, and the packed buffers `tiles` whole tiles of every head.
        unsafe { b.launch(cfg) }.ctx(format!("launching {entry}"))?;
        Ok(())
    }

    /// `prefill_attention` of `rows` over packed keys at `k_pos`.
    fn prefill_attention(
        &self,
        shape: &AttnShape,
        rows: BlockRows,
        k_pos: &CudaSlice<u32>,
        dims: Dims,
        packed: &PackedKeys,
        results: Results,
    ) -> Result<()> {
        let op = "causal_attention";
        let kernel = Kernel::Prefill {
            dtype: packed.dtype,
            head_dim: shape.head_dim,
            entry: "prefill_attention",
        };
        let launch = PrefillLaunch::for_device(&self.arch, shape.head_dim);
        let gsz = shape.q_heads / shape.kv_heads;
        let cta_queries = launch.rows / gsz;
        let scale_log2 = shape.softmax_scale() * std::f32::consts::LOG2_E;
        let (q_heads, kv_heads) = (dims.q_heads as i32, dims.kv_heads as i32);
        let cta_queries_u32 = narrow(op, cta_queries)?;
        let attend = self.function(kernel)?;
        let cfg = LaunchConfig {
            grid_dim: (
                narrow(op, (dims.rows as usize).div_ceil(cta_queries))?,
                dims.kv_heads,
                1,
            ),
            block_dim: (launch.threads, 1, 1),
            shared_mem_bytes: narrow(op, launch.shared_bytes)?,
        };
        let no_windows = 0u64;
        let mut b = self.stream.launch_builder(&attend);
        b.arg(&rows.q.data).arg(rows.q_pos);
        match rows.q_from {
            Some(from) => b.arg(from),
            None => b.arg(&no_windows),
        };
        b.arg(&dims.rows)
            .arg(&packed.k)
            .arg(&packed.v)
            .arg(k_pos)
            .arg(&packed.bounds)
            .arg(&dims.tokens);
        let null = 0u64;
        match results {
            Results::States(states) => b.arg(&mut states.o).arg(&mut states.lse).arg(&null),
            Results::Output(out) => b.arg(&null).arg(&null).arg(out),
        };
        b.arg(&q_heads)
            .arg(&kv_heads)
            .arg(&cta_queries_u32)
            .arg(&scale_log2);
        // SAFETY: CTA (x, kvh) holds queries x·cta_queries.. (below `rows`) × the gsz heads of
        // KV head kvh, at most the launch's rows; q, q_pos, q_from (or null) and the states
        // (or the output, with the states null) hold `rows` rows of q_heads cells, the packed
        // keys, bounds and k_pos hold `tokens` keys in whole tiles, and the shared memory is
        // the kernel's stages (the function's maximum was raised to it).
        unsafe { b.launch(cfg) }.ctx("launching prefill_attention")?;
        Ok(())
    }

    /// `layers.cu`'s `causal_attention`, compiled for the keys' dtype.
    fn attend_on_cuda_cores(&self, block: &Block, states: &mut CudaStates) -> Result<()> {
        let op = "causal_attention";
        let (shape, q, keys, dims) = (block.shape, block.q, block.keys, block.dims);
        let (q_pos, k_pos): (&CudaSlice<u32>, &CudaSlice<u32>) = (&block.q_pos, &block.k_pos);
        let no_windows = 0u64;
        let Dims {
            rows,
            tokens,
            q_heads,
            kv_heads,
            head_dim,
        } = dims;
        let (k, v) = (keys.k, keys.v);
        let scale = shape.softmax_scale();
        let f = self.function(Kernel::Layers(keys.dtype, "causal_attention"))?;
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
        b.arg(&q.data).arg(q_pos);
        match block.q_from.as_deref() {
            Some(from) => b.arg(from),
            None => b.arg(&no_windows),
        };
        b.arg(&k.data)
            .arg(&v.data)
            .arg(k_pos)
            .arg(&tokens)
            .arg(&mut states.o)
            .arg(&mut states.lse)
            .arg(&rows)
            .arg(&q_heads)
            .arg(&kv_heads)
            .arg(&head_dim)
            .arg(&scale);
        // SAFETY: one warp per CAUSAL_ROWS rows of a head, rows below `rows`; q, q_pos, q_from
        // (or null) and the states hold those cells of head_dim floats (and one lse each), k
        // and v `tokens` rows of kv_heads heads, and the GQA ratio is whole (checked), so every
        // index is within its buffer.
        unsafe { b.launch(cfg) }.ctx("launching causal_attention")?;
        Ok(())
    }
}

/// Where `prefill_attention` leaves its rows' results.
enum Results<'a> {
    /// Merged into the rows' states.
    States(&'a mut CudaStates),
    /// The output itself, `rows × q_heads · head_dim` rounded to the KV dtype: the block is
    /// every key the rows see.
    Output(&'a mut CudaSlice<u16>),
}

/// One block's attention, checked, its positions on the device.
struct Block<'a> {
    shape: &'a AttnShape,
    q: &'a CudaTensor,
    q_pos: Arc<CudaSlice<u32>>,
    q_from: Option<Arc<CudaSlice<u32>>>,
    keys: KeyBlock<'a, CudaTensor>,
    k_pos: Arc<CudaSlice<u32>>,
    dims: Dims,
}

/// The query rows of `prefill_attention`: their positions and, where they have windows, the
/// windows' starts.
#[derive(Clone, Copy)]
struct BlockRows<'a> {
    q: &'a CudaTensor,
    q_pos: &'a CudaSlice<u32>,
    q_from: Option<&'a CudaSlice<u32>>,
}

/// The sizes one block's attention launches with, checked to fit the kernels' u32s.
#[derive(Debug, Clone, Copy)]
struct Dims {
    rows: u32,
    tokens: u32,
    q_heads: u32,
    kv_heads: u32,
    head_dim: u32,
}

impl Dims {
    fn of(op: &str, shape: &AttnShape, rows: usize, tokens: usize) -> Result<Dims> {
        Ok(Dims {
            rows: narrow(op, rows)?,
            tokens: narrow(op, tokens)?,
            q_heads: narrow(op, shape.q_heads)?,
            kv_heads: narrow(op, shape.kv_heads)?,
            head_dim: narrow(op, shape.head_dim)?,
        })
    }
}

/// Where a block's keys come from, for `prefill.cu`'s packers: fp32 activations (`pack_keys`)
/// or a KV cache's physical slots (`gather_keys`).
#[derive(Clone, Copy)]
enum Packer<'a> {
    Rows {
        k: &'a CudaSlice<f32>,
        v: &'a CudaSlice<f32>,
    },
    Cache {
        k: &'a CudaSlice<u8>,
        v: &'a CudaSlice<u8>,
        slots: &'a CudaSlice<u32>,
    },
}

/// A block's keys and values in `prefill.cu`'s tiles (head-major, 16-bit, padded to whole
/// tiles), with each tile's smallest and largest position.
struct PackedKeys {
    dtype: DType,
    tiles: u32,
    k: CudaSlice<u16>,
    v: CudaSlice<u16>,
    bounds: CudaSlice<u32>,
}

impl PackedKeys {
    /// The packing kernels' launch: one CTA per tile and KV head.
    fn launch(&self, kv_heads: u32) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (self.tiles, kv_heads, 1),
            block_dim: (LAYER_THREADS, 1, 1),
            shared_mem_bytes: 0,
        }
    }
}

/// Refuses states that are not `q`'s rows of the shape's heads.
fn check_states(op: &str, shape: &AttnShape, q: &CudaTensor, states: &CudaStates) -> Result<()> {
    expect_size("cuda", op, "the states' rows", states.rows, q.rows)?;
    expect_size("cuda", op, "the states' heads", states.heads, shape.q_heads)?;
    expect_size(
        "cuda",
        op,
        "the states' head dim",
        states.head_dim,
        shape.head_dim,
    )?;
    Ok(())
}

/// Whether `prefill.cu` runs a block of keys of `dtype` for `shape`: 16-bit KV, a head dim the
/// tensor-core kernels hold, and a GQA group that fits a CTA's rows.
fn on_tensor_cores(shape: &AttnShape, dtype: DType) -> bool {
    dtype != DType::F32
        && MMA_HEAD_DIMS.contains(&shape.head_dim)
        && shape.q_heads / shape.kv_heads <= PREFILL_ROWS
}

/// Whether `gather_and_attend` reads `kv`'s keys for `shape`: the tensor cores hold the shape
/// and the cache is of it.
fn gathers_on_tensor_cores(shape: &AttnShape, kv: &CudaKv) -> bool {
    on_tensor_cores(shape, kv.dtype) && kv.shape == *shape
}
