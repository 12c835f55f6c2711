//! The engine's [`LayerOps`] on the CUDA backend: a Llama model's dense layers on the GPU.
//!
//! Activations ([`CudaTensor`]) are fp32 device matrices; weights ([`CudaWeight`]) keep the
//! dtype they were uploaded in (bf16 by default, f16 or f32), as does the KV cache. The GEMMs
//! of many rows run on cuBLAS and those of a decode step on canopy's GEMV ([`gemm`]); every
//! op is otherwise a kernel of `layers.cu` and its continuations `gemv.cu` and `logits.cu`
//! (the kernel registry's [`Kernel::Layers`]) in fp32, its weight or KV operand widened on load or
//! narrowed on store. RoPE ([`rope`]) runs on its own or in the q|k|v GEMV's epilogue.
//! Only token ids, positions, RoPE frequencies and KV slots come from the host, one small copy
//! per call; the attention of a block of query rows merges into states that the decode path's
//! kernels share ([`CudaStates`]).
//!
//! Every op checks its operands' shapes before it launches anything and returns an error on a
//! mismatch: a caller's bug is reported, never a kernel reading past a buffer.

mod attention;
mod gemm;
mod outputs;
mod rope;
mod tensor;
mod top;
mod tuning;
mod walks;

pub use tensor::{CudaTensor, CudaWeight};

pub(crate) use gemm::LayerState;
pub(crate) use walks::WalkScratch;

use gemm::{activation_len, gemv_fits, product_rows, Epilogue, GateUp, GemvRows, StepInput};

use crate::backend::{CudaBackend, CudaQueries, CudaStates, EResult};
use crate::descriptors::CudaPlan;
use crate::error::{CudaError, DriverContext, Result};
use crate::kv::CudaKv;
use crate::launch::Params;
use canopy_core::logits::TailWalk;
use canopy_core::shape::SUPPORTED_HEAD_DIMS;
use canopy_core::{AttnShape, DType, TypedSliceMut, TypedVec};
use canopy_engine::layer_ops::{
    attention_output_through_states, check_logit_places, check_logprob_terms, check_pick_logits,
    check_softmax_totals, check_top_logits, check_walk_tails, expect_gather, expect_size,
};
use canopy_engine::{CachedKeys, EngineError, FillRun, KeyBlock, KvStore, LayerOps, ModelNeeds};
use canopy_kernels::{Kernel, LAYER_THREADS, PREFILL_TILE};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

/// Grid-stride CTAs per SM of the element-wise kernels: enough resident warps to hide memory
/// latency, few enough that each thread loops over several elements of a large tensor.
const ELEMENTWISE_CTAS_PER_SM: usize = 8;
/// Device memory [`LayerOps::check_model`] keeps free beyond its estimate: cuBLAS's and
/// cuBLASLt's workspaces, the kernel modules, the decode plans, the driver's own allocations,
/// and while a server's warm-up times its products, the buffer that evicts L2 (four L2s).
const RESERVE_BYTES: u64 = 512 << 20;
/// Device memory [`LayerOps::check_model`] keeps free for NCCL per peer GPU: its buffers for
/// each channel to a peer (`NCCL_BUFFSIZE` per channel and protocol) and its own structures,
/// allocated when the ranks connect, after the check. Two H200 ranks needed about 0.3 GiB
/// beyond [`RESERVE_BYTES`].
const NCCL_BYTES_PER_PEER: u64 = 512 << 20;

/// Refuses a tensor whose `(rows, cols)` differ from `want`'s.
fn same_dims(op: &str, what: &str, t: &CudaTensor, want: (usize, usize)) -> Result<()> {
    if (t.rows, t.cols) == want {
        Ok(())
    } else {
        Err(CudaError::Unsupported(format!(
            "{op}: {what} is {} × {}, expected {} × {}",
            t.rows, t.cols, want.0, want.1
        )))
    }
}

/// Refuses an RMSNorm weight that is not as long as x's rows.
fn check_norm_weight(x: &CudaTensor, weight: &CudaWeight) -> Result<()> {
    Ok(expect_size(
        "cuda",
        "rms_norm",
        "the weight's length",
        weight.rows * weight.cols,
        x.cols,
    )?)
}

/// A kernel size argument as the kernels' `u32`.
pub(crate) fn narrow(op: &str, n: usize) -> Result<u32> {
    u32::try_from(n).map_err(|_| {
        CudaError::Unsupported(format!(
            "{op}: a size of {n} is past the kernels' 32-bit indices; use smaller chunks"
        ))
    })
}

/// Device bytes of one forward pass's activations at `needs.max_rows` rows, the buffers a
/// layer holds at once.
fn activation_bytes(needs: &ModelNeeds) -> u64 {
    let s = &needs.shape;
    let floats = 3 * needs.hidden // the residual stream, its norm, a projection's output
        + 3 * s.q_row_elems() // q, the states' o, the attention output
        + s.q_heads // the states' lse
        + 2 * s.kv_token_elems() // k and v
        + 2 * needs.intermediate; // the MLP's gate and up

    // A 16-bit GEMM's input in the scratch, and the rounded copies GEMM operands keep (the
    // attention output, a norm's output and the MLP's activation at once).
    let rounded = 2
        * (needs.hidden.max(needs.intermediate)
            + s.q_row_elems()
            + needs.hidden
            + needs.intermediate);
    let logits = needs.logit_rows * needs.vocab * (4 + 2);
    // Every rank's queries, their states (o and lse), the output, and the merge's packed
    // states and maxima.
    let attention_floats = 4 * s.q_row_elems() + 3 * s.q_heads;
    // The cached keys and values read as f32, then packed to 16 bits in whole tiles.
    let key_bytes = s.kv_token_elems() * 2 * (4 + 2);
    (product_rows(needs.max_rows) * (4 * floats + rounded)
        + needs.attention_rows * 4 * attention_floats
        + needs.attention_keys.next_multiple_of(PREFILL_TILE) * key_bytes
        + logits) as u64
}

/// `(row, slot)` stores as `store_kv` reads them: row and slot, alternating.
fn slot_pairs(rows: &[(u32, u32)]) -> Vec<u32> {
    rows.iter().flat_map(|&(row, slot)| [row, slot]).collect()
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

impl CudaBackend {
    /// The threads of the largest grid [`CudaBackend::elementwise`] launches.
    fn elementwise_threads(&self) -> usize {
        self.gpu.multiprocessors as usize * ELEMENTWISE_CTAS_PER_SM * LAYER_THREADS as usize
    }

    /// A grid-stride launch over `n` elements.
    fn elementwise(&self, n: usize) -> LaunchConfig {
        let most = self.gpu.multiprocessors as usize * ELEMENTWISE_CTAS_PER_SM;
        LaunchConfig {
            grid_dim: (
                n.div_ceil(LAYER_THREADS as usize).clamp(1, most) as u32,
                1,
                1,
            ),
            block_dim: (LAYER_THREADS, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    fn check_model_needs(&self, needs: &ModelNeeds) -> Result<()> {
        let s = &needs.shape;
        if s.kv_heads == 0 || !s.q_heads.is_multiple_of(s.kv_heads) {
            return Err(CudaError::Unsupported(format!(
                "the model's {} query heads cannot share its {} KV heads evenly; it is not a grouped-query Llama this backend runs",
                s.q_heads, s.kv_heads
            )));
        }
        // The decode kernels are built for these head dims; the prefill attention and RoPE
        // (pairs of columns) hold every one of them.
        if !SUPPORTED_HEAD_DIMS.contains(&s.head_dim) || !attention::holds(s.head_dim) {
            return Err(CudaError::Unsupported(format!(
                "the model's head dim {} is not one the CUDA kernels are built for ({SUPPORTED_HEAD_DIMS:?}); run it with --backend cpu",
                s.head_dim
            )));
        }
        // Every DType (f32, f16, bf16) is one the kernels and cuBLAS take; bf16 GEMMs need
        // Ampere or later.
        if needs.weight_dtype == DType::Bf16 && self.gpu.compute_capability.0 < 8 {
            return Err(CudaError::Unsupported(format!(
                "GPU {} ({}) has no bf16 GEMMs (compute capability {}.{}); load the weights in f16 or f32",
                self.gpu.ordinal,
                self.gpu.name,
                self.gpu.compute_capability.0,
                self.gpu.compute_capability.1
            )));
        }
        if !gemm::cublas_present() {
            return Err(gemm::no_cublas());
        }
        let (weights, kv, activations) = (
            needs.weight_bytes,
            needs.kv_bytes(),
            activation_bytes(needs),
        );
        let reserve = RESERVE_BYTES + needs.peer_devices as u64 * NCCL_BYTES_PER_PEER;
        let total = weights + kv + activations + reserve;
        let free = self.free_bytes()?;
        if total > free {
            let nccl = match needs.peer_devices {
                0 => String::new(),
                peers => format!(" with NCCL's buffers for {peers} peer GPUs"),
            };
            // Only f32 weights or KV have a smaller dtype to offer.
            let halve = match (needs.weight_dtype, needs.kv_dtype) {
                (DType::F32, _) | (_, DType::F32) => "16-bit weights and KV (--dtype bf16), ",
                _ => "",
            };
            return Err(CudaError::Unsupported(format!(
                "the model needs {:.2} GiB on GPU {} (weights {:.2}, KV cache {:.2}, activations {:.2}, reserve {:.2}{nccl}) but {:.2} GiB are free; use {halve}fewer tokens (a shorter prompt or --max-tokens), fewer samples (--n), or more ranks to share the KV cache",
                gib(total),
                self.gpu.ordinal,
                gib(weights),
                gib(kv),
                gib(activations),
                gib(reserve),
                gib(free)
            )));
        }
        Ok(())
    }

    fn embed_rows(&self, table: &CudaWeight, ids: &[u32], out: &mut CudaTensor) -> Result<()> {
        same_dims("embed", "the output", out, (ids.len(), table.cols))?;
        out.drop_rounded();
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= table.rows) {
            return Err(CudaError::Unsupported(format!(
                "embed: token id {id} is outside the embedding table of {} rows; the tokenizer and the model disagree",
                table.rows
            )));
        }
        let n = ids.len() * table.cols;
        if n == 0 {
            return Ok(());
        }
        let (rows, cols) = (narrow("embed", ids.len())?, narrow("embed", table.cols)?);
        let ids = self.upload_step_input(StepInput::Ids, ids)?;
        let f = self.function(Kernel::Layers(table.dtype, "embed_rows"))?;
        let mut b = self.stream.launch_builder(&f);
        b.arg(&table.data)
            .arg(&*ids)
            .arg(&mut out.data)
            .arg(&rows)
            .arg(&cols);
        // SAFETY: every id is below the table's rows (checked), and out holds rows × cols.
        unsafe { b.launch(self.elementwise(n)) }.ctx("launching embed_rows")?;
        Ok(())
    }

    fn rms_norm_rows(
        &self,
        x: &CudaTensor,
        weight: &CudaWeight,
        eps: f32,
        out: &mut CudaTensor,
    ) -> Result<()> {
        check_norm_weight(x, weight)?;
        same_dims("rms_norm", "the output", out, (x.rows, x.cols))?;
        if x.rows == 0 || x.cols == 0 {
            return Ok(());
        }
        let (rows, cols) = (narrow("rms_norm", x.rows)?, narrow("rms_norm", x.cols)?);
        let f = self.function(Kernel::Layers(weight.dtype, "rms_norm"))?;
        let rounded = self.rounded_target(out, weight.dtype)?;
        let s = &self.stream;
        // A rounded copy is all a GEMM operand's product reads: its fp32 values are not written.
        let values = rounded.is_none().then_some(&out.data);
        let params = Params::default()
            .buffer(x.values("rms_norm")?, s)
            .buffer(&weight.data, s)
            .optional_buffer(values, s)
            .optional_buffer(rounded.as_ref(), s)
            .u32(cols)
            .f32(eps);
        let cfg = LaunchConfig {
            grid_dim: (rows, 1, 1),
            block_dim: (LAYER_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: one CTA per row of x and out (rows × cols each; out only without a rounded
        // copy), and of the rounded copy (rows × cols elements) if there is one; the weight has
        // cols elements.
        unsafe { self.launch_dependent(&f, cfg, &params) }.ctx("launching rms_norm")?;
        out.rounded = rounded;
        Ok(())
    }

    /// The buffer a producer writes `out`'s values into, rounded, in place of `out`'s fp32
    /// values, when that kernel rounds to `dtype` and `out` feeds a weight of it; None (and the
    /// copy dropped: the producer writes `data`) otherwise. The caller sets it back on `out`
    /// once the kernel is queued.
    fn rounded_target(&self, out: &mut CudaTensor, dtype: DType) -> Result<Option<CudaSlice<u16>>> {
        let kept = out.rounded.take();
        if out.operand != Some(dtype) {
            return Ok(None);
        }
        let len = activation_len(out.rows, out.cols);
        Ok(Some(match kept {
            Some(buf) if buf.len() >= len => buf,
            _ => self.alloc::<u16>(len)?,
        }))
    }

    /// An uninitialized `rows × cols` activation, for a result written in full before it is
    /// read; it holds the rows its products run at ([`activation_len`]).
    fn tensor_of(&self, rows: usize, cols: usize) -> Result<CudaTensor> {
        Ok(CudaTensor::new(
            self.alloc::<f32>(activation_len(rows, cols))?,
            rows,
            cols,
        ))
    }

    /// `out = silu(gate) * up` over the two halves of each row of `gate_up` (`out.rows ×
    /// 2 out.cols`: the caller sized it).
    fn swiglu_halves(&self, gate_up: GateUp, out: &mut CudaTensor) -> Result<()> {
        if let GateUp::F32(t) = gate_up {
            same_dims("matmul_swiglu", "the output", out, (t.rows, t.cols / 2))?;
        }
        let n = out.rows * out.cols;
        if n == 0 {
            return Ok(());
        }
        let (rows, cols) = (
            narrow("matmul_swiglu", out.rows)?,
            narrow("matmul_swiglu", out.cols)?,
        );
        let dtype = out.operand.unwrap_or(DType::F32);
        let f = match gate_up {
            GateUp::F32(_) => self.function(Kernel::Layers(dtype, "swiglu"))?,
            // Compiled for the product's dtype: the rounded copy, if any, is of the same one
            // (a 16-bit weight's operand).
            GateUp::Narrow(_, held) if dtype == DType::F32 || dtype == held => {
                self.function(Kernel::Layers(held, "swiglu_narrow"))?
            }
            GateUp::Narrow(_, held) => {
                return Err(CudaError::Unsupported(format!(
                    "matmul_swiglu: a {held} gate|up product cannot feed a {dtype} operand; load every weight in one dtype"
                )))
            }
        };
        let mut rounded = self.rounded_target(out, dtype)?;
        let null = 0u64;
        if let GateUp::F32(t) = gate_up {
            t.values("matmul_swiglu")?;
        }
        let mut b = self.stream.launch_builder(&f);
        match gate_up {
            GateUp::F32(t) => b.arg(&t.data),
            GateUp::Narrow(held, _) => b.arg(held),
        };
        // A rounded copy is all a GEMM operand's product reads: its fp32 values are not written.
        match rounded.as_mut() {
            Some(buf) => b.arg(&null).arg(buf),
            None => b.arg(&mut out.data).arg(&null),
        };
        b.arg(&rows).arg(&cols);
        // SAFETY: gate_up holds rows × 2 cols elements of the kernel's input type (checked,
        // or sized by the caller); the kernel writes rows × cols elements of the rounded copy
        // where there is one (checked), else of out, which holds them.
        unsafe { b.launch(self.elementwise(n)) }.ctx("launching swiglu")?;
        out.rounded = rounded;
        Ok(())
    }

    fn store_rows(
        &self,
        kv: &mut CudaKv,
        k: &CudaTensor,
        v: &CudaTensor,
        rows: &[(u32, u32)],
    ) -> Result<()> {
        same_dims("store_kv", "v", v, (k.rows, k.cols))?;
        self.check_stores(kv, k, rows)?;
        let width = kv.shape.kv_token_elems();
        if rows.is_empty() || width == 0 {
            return Ok(());
        }
        let (count, width_) = (narrow("store_kv", rows.len())?, narrow("store_kv", width)?);
        let pairs = self.upload_step_input(StepInput::Slots, &slot_pairs(rows))?;
        let f = self.function(Kernel::Layers(kv.dtype, "store_kv"))?;
        let s = &self.stream;
        let params = Params::default()
            .buffer(&k.data, s)
            .buffer(&v.data, s)
            .buffer(&*pairs, s)
            .buffer(&kv.k, s)
            .buffer(&kv.v, s)
            .u32(count)
            .u32(width_);
        // SAFETY: every row is one of k's and v's (rows × width floats each) and every slot
        // one of the pool's, whose K and V hold `pool` tokens of `width` elements of the KV's
        // dtype (both checked).
        unsafe { self.launch_dependent(&f, self.elementwise(rows.len() * width), &params) }
            .ctx("launching store_kv")?;
        Ok(())
    }

    /// [`LayerOps::load_kv`]: `layers.cu`'s `load_kv`, compiled for the KV's dtype.
    pub(super) fn load_rows(&self, kv: &CudaKv, slots: &[u32]) -> Result<(CudaTensor, CudaTensor)> {
        let width = kv.shape.kv_token_elems();
        kv.check_slots("load_kv", slots)?;
        let (mut k, mut v) = (
            self.tensor_of(slots.len(), width)?,
            self.tensor_of(slots.len(), width)?,
        );
        if slots.is_empty() || width == 0 {
            return Ok((k, v));
        }
        let (count, width_) = (narrow("load_kv", slots.len())?, narrow("load_kv", width)?);
        let slots = self.upload(slots)?;
        let f = self.function(Kernel::Layers(kv.dtype, "load_kv"))?;
        let mut b = self.stream.launch_builder(&f);
        b.arg(&kv.k)
            .arg(&kv.v)
            .arg(&slots)
            .arg(&mut k.data)
            .arg(&mut v.data)
            .arg(&count)
            .arg(&width_);
        // SAFETY: every slot is one of the pool's (checked), whose K and V hold `pool` tokens of
        // `width` elements of the KV's dtype; k and v hold `count` rows of `width` floats.
        unsafe { b.launch(self.elementwise(slots.len() * width)) }.ctx("launching load_kv")?;
        Ok((k, v))
    }
}

/// `q`'s values as attention queries for `op`: a row of the shape's query width each.
fn query_values<'a>(op: &str, shape: &AttnShape, q: &'a CudaTensor) -> EResult<&'a CudaSlice<f32>> {
    expect_size("cuda", op, "the query width", q.cols, shape.q_row_elems())?;
    Ok(q.values(op)?)
}

impl LayerOps for CudaBackend {
    type Tensor = CudaTensor;
    type Weight = CudaWeight;
    type Graph = crate::CudaGraph;

    fn preferred_dtype(&self) -> DType {
        DType::Bf16
    }

    /// Refuses head dims the kernels are not built for (every supported one is even, as RoPE
    /// needs), uneven GQA, bf16 weights on a GPU without bf16 GEMMs, a missing cuBLAS, and a
    /// model whose weights, KV cache and activations do not fit the GPU's free memory.
    fn check_model(&self, needs: &ModelNeeds) -> EResult<()> {
        Ok(self.check_model_needs(needs)?)
    }

    /// Copies through page-locked buffers (`staging`), and waits for the copy, so that
    /// backends on other streams of the device (ranks sharing the GPU) may read the weight as
    /// soon as this returns.
    fn upload_weight(&self, data: &TypedVec, rows: usize, cols: usize) -> EResult<CudaWeight> {
        expect_size(
            "cuda",
            "upload_weight",
            "the element count",
            data.len(),
            rows * cols,
        )?;
        let (bytes, width) = (data.as_bytes(), data.dtype().size_bytes());
        let weight =
            self.upload_weight_with(data.dtype(), (rows, cols), &mut |first, mut part| {
                let to = part.as_bytes_mut();
                to.copy_from_slice(&bytes[first * width..first * width + to.len()]);
                Ok::<(), EngineError>(())
            })?;
        self.finish_uploads()?;
        Ok(weight)
    }

    /// `fill` writes each part into a page-locked buffer that is then copied, while `fill`
    /// writes the next into the other.
    fn upload_weight_with<E: From<EngineError>>(
        &self,
        dtype: DType,
        (rows, cols): (usize, usize),
        fill: &mut dyn FnMut(usize, TypedSliceMut) -> Result<(), E>,
    ) -> Result<CudaWeight, E> {
        Ok(CudaWeight {
            data: self.upload_filled(dtype, rows * cols, fill)?,
            dtype,
            rows,
            cols,
        })
    }

    fn finish_uploads(&self) -> EResult<()> {
        Ok(CudaBackend::finish_uploads(self)?)
    }

    fn tensor(&self, rows: usize, cols: usize) -> EResult<CudaTensor> {
        let len = activation_len(rows, cols).max(1);
        let data = self
            .stream
            .alloc_zeros::<f32>(len)
            .ctx(format!("allocating {} bytes", len * 4))?;
        Ok(CudaTensor::new(data, rows, cols))
    }

    fn output_tensor(&self, rows: usize, cols: usize) -> EResult<CudaTensor> {
        Ok(self.tensor_of(rows, cols)?)
    }

    /// A product the GEMV does not take runs on cuBLAS, whose 16-bit operand the producer
    /// writes.
    fn gemm_operand(&self, rows: usize, cols: usize, weight: &CudaWeight) -> EResult<CudaTensor> {
        let mut t = self.tensor_of(rows, cols)?;
        if !gemm::gemv_fits(rows, cols, weight) && weight.dtype != DType::F32 {
            t.operand = Some(weight.dtype);
        }
        Ok(t)
    }

    fn upload_tensor(&self, data: &[f32], rows: usize, cols: usize) -> EResult<CudaTensor> {
        expect_size(
            "cuda",
            "upload_tensor",
            "the element count",
            data.len(),
            rows * cols,
        )?;
        let mut t = self.tensor_of(rows, cols)?;
        self.write_or_grow(data, &mut t.data, "a tensor's upload")?;
        Ok(t)
    }

    fn download_tensor(&self, t: &CudaTensor) -> EResult<Vec<f32>> {
        let values = t.values("download_tensor")?.slice(..t.rows * t.cols);
        let host = self.stream.clone_dtoh(&values).ctx("cuMemcpyDtoH")?;
        self.stream.synchronize().ctx("cuStreamSynchronize")?;
        Ok(host)
    }

    fn dims(&self, t: &CudaTensor) -> (usize, usize) {
        (t.rows, t.cols)
    }

    fn gather_rows(&self, src: &CudaTensor, rows: &[usize], out: &mut CudaTensor) -> EResult<()> {
        expect_size(
            "cuda",
            "gather_rows",
            "the output's columns",
            out.cols,
            src.cols,
        )?;
        expect_gather("cuda", rows, src.rows, out.rows)?;
        out.drop_rounded();
        let input = StepInput::GatherRows;
        Ok(self.copy_row_runs(&src.data, &mut out.data, rows, src.cols, input)?)
    }

    fn gather_states(&self, src: &CudaStates, rows: &[usize], out: &mut CudaStates) -> EResult<()> {
        self.gather_state_rows(src, rows, out)
    }

    fn embed(&self, table: &CudaWeight, ids: &[u32], out: &mut CudaTensor) -> EResult<()> {
        Ok(self.embed_rows(table, ids, out)?)
    }

    fn rms_norm(
        &self,
        x: &CudaTensor,
        weight: &CudaWeight,
        eps: f32,
        out: &mut CudaTensor,
    ) -> EResult<()> {
        Ok(self.rms_norm_rows(x, weight, eps, out)?)
    }

    fn matmul(&self, x: &CudaTensor, w: &CudaWeight, out: &mut CudaTensor) -> EResult<()> {
        Ok(self.checked_product(x, w, out, Epilogue::Store)?)
    }

    fn matmul_add(&self, x: &CudaTensor, w: &CudaWeight, acc: &mut CudaTensor) -> EResult<()> {
        Ok(self.checked_product(x, w, acc, Epilogue::Add)?)
    }

    fn matmul_swiglu(&self, x: &CudaTensor, w: &CudaWeight, out: &mut CudaTensor) -> EResult<()> {
        Ok(self.checked_product(x, w, out, Epilogue::Swiglu)?)
    }

    fn rms_norm_matmul(
        &self,
        x: &CudaTensor,
        norm: (&CudaWeight, f32),
        w: &CudaWeight,
        normed: &mut CudaTensor,
        out: &mut CudaTensor,
    ) -> EResult<()> {
        Ok(self.normed_product(x, norm, w, normed, out, Epilogue::Store)?)
    }

    fn rms_norm_matmul_swiglu(
        &self,
        x: &CudaTensor,
        norm: (&CudaWeight, f32),
        w: &CudaWeight,
        normed: &mut CudaTensor,
        out: &mut CudaTensor,
    ) -> EResult<()> {
        Ok(self.normed_product(x, norm, w, normed, out, Epilogue::Swiglu)?)
    }

    fn rope_split(
        &self,
        qkv: &CudaTensor,
        positions: &[u32],
        inv_freq: &CudaWeight,
        q: &mut CudaTensor,
        k: &mut CudaTensor,
        v: &mut CudaTensor,
    ) -> EResult<()> {
        Ok(self.rope(qkv, positions, inv_freq, (q, k, v), None)?)
    }

    fn rms_norm_matmul_rope(
        &self,
        x: &CudaTensor,
        norm: (&CudaWeight, f32),
        w: &CudaWeight,
        scratch: (&mut CudaTensor, &mut CudaTensor),
        positions: &[u32],
        inv_freq: &CudaWeight,
        qkv: (&mut CudaTensor, &mut CudaTensor, &mut CudaTensor),
        store: Option<KvStore<'_, Self>>,
    ) -> EResult<()> {
        Ok(self.qkv_rope(x, norm, w, scratch, positions, inv_freq, qkv, store)?)
    }

    fn rope_split_store(
        &self,
        qkv: &CudaTensor,
        positions: &[u32],
        inv_freq: &CudaWeight,
        qkv_out: (&mut CudaTensor, &mut CudaTensor, &mut CudaTensor),
        kv: &mut CudaKv,
        rows: &[(u32, u32)],
    ) -> EResult<()> {
        Ok(self.rope(qkv, positions, inv_freq, qkv_out, Some((kv, rows)))?)
    }

    fn tensor_buf<'t>(&self, t: &'t CudaTensor) -> &'t CudaSlice<f32> {
        &t.data
    }

    fn tensor_buf_mut<'t>(&self, t: &'t mut CudaTensor) -> &'t mut CudaSlice<f32> {
        t.drop_rounded();
        &mut t.data
    }

    fn load_kv(&self, kv: &CudaKv, slots: &[u32]) -> EResult<(CudaTensor, CudaTensor)> {
        Ok(self.load_rows(kv, slots)?)
    }

    fn store_kv(
        &self,
        kv: &mut CudaKv,
        k: &CudaTensor,
        v: &CudaTensor,
        rows: &[(u32, u32)],
    ) -> EResult<()> {
        Ok(self.store_rows(kv, k, v, rows)?)
    }

    fn fill_kv_random(
        &self,
        shape: &AttnShape,
        kv: &mut CudaKv,
        seed: u64,
        runs: &[FillRun],
    ) -> EResult<()> {
        expect_size(
            "cuda",
            "fill_kv_random",
            "the KV's token width",
            kv.shape.kv_token_elems(),
            shape.kv_token_elems(),
        )?;
        for run in runs {
            self.fill_random(kv, run.slot as usize, run.tokens, seed, run.position)?;
        }
        Ok(())
    }

    fn tensor_queries(&self, shape: &AttnShape, q: &CudaTensor) -> EResult<CudaQueries> {
        let values = query_values("tensor_queries", shape, q)?;
        Ok(CudaQueries {
            q: self.stream.clone_dtod(values).ctx("cuMemcpyDtoDAsync")?,
            rows: q.rows,
        })
    }

    fn take_queries(&self, shape: &AttnShape, q: CudaTensor) -> EResult<CudaQueries> {
        query_values("take_queries", shape, &q)?;
        Ok(CudaQueries {
            q: q.data,
            rows: q.rows,
        })
    }

    fn empty_states(&self, shape: &AttnShape, rows: usize) -> EResult<CudaStates> {
        Ok(self.empty(shape, rows)?)
    }

    fn causal_attention_from(
        &self,
        shape: &AttnShape,
        q: &CudaTensor,
        q_pos: &[u32],
        q_from: Option<&[u32]>,
        keys: KeyBlock<'_, CudaTensor>,
        states: &mut CudaStates,
    ) -> EResult<()> {
        Ok(self.attend_block(shape, q, q_pos, q_from, keys, states)?)
    }

    fn cached_attention(
        &self,
        shape: &AttnShape,
        q: &CudaTensor,
        q_pos: &[u32],
        keys: CachedKeys<'_, CudaKv>,
        states: &mut CudaStates,
    ) -> EResult<()> {
        Ok(self.attend_cached(shape, q, q_pos, keys, states)?)
    }

    fn cached_attention_output(
        &self,
        shape: &AttnShape,
        q: &CudaTensor,
        q_pos: &[u32],
        keys: CachedKeys<'_, CudaKv>,
        out: &mut CudaTensor,
    ) -> EResult<()> {
        if self.attend_cached_into(shape, q, q_pos, keys, out)? {
            return Ok(());
        }
        attention_output_through_states(self, shape, q, q_pos, keys, out)
    }

    fn states_output(&self, states: &CudaStates, out: &mut CudaTensor) -> EResult<()> {
        Ok(self.output_of_states(states, out)?)
    }

    fn step_output(
        &self,
        kv: &CudaKv,
        q: &CudaQueries,
        plan: &CudaPlan,
        partials: &mut CudaStates,
        states: &mut CudaStates,
        out: &mut CudaTensor,
    ) -> EResult<bool> {
        self.step_into_output(kv, q, plan, partials, states, out)
    }

    fn merge_into_output(
        &self,
        acc: &mut CudaStates,
        x: &CudaStates,
        out: &mut CudaTensor,
    ) -> EResult<bool> {
        self.merge_pair_into_output(acc, x, out)
    }

    /// A product the GEMV takes reads the outputs where the states hold them: no copy into
    /// `scratch`, and the same bits.
    fn states_matmul_add(
        &self,
        states: &CudaStates,
        w: &CudaWeight,
        scratch: &mut CudaTensor,
        acc: &mut CudaTensor,
    ) -> EResult<()> {
        let (rows, cols) = (states.rows, states.heads * states.head_dim);
        if !gemv_fits(rows, cols, w) || rows == 0 || cols == 0 || w.rows == 0 {
            self.states_output(states, scratch)?;
            return self.matmul_add(scratch, w, acc);
        }
        Epilogue::Add.check((rows, cols), w, acc)?;
        acc.drop_rounded();
        let x = GemvRows {
            values: &states.o,
            rows,
            cols,
        };
        Ok(self.gemv(x, w, None, acc, Epilogue::Add)?)
    }

    fn top_logits(&self, logits: &CudaTensor, k: usize, out: &mut CudaTensor) -> EResult<()> {
        let dims = ((logits.rows, logits.cols), (out.rows, out.cols));
        check_top_logits("cuda", dims.0, k, dims.1)?;
        Ok(self.top_rows(logits, k, out)?)
    }

    fn logprob_terms(
        &self,
        logits: &CudaTensor,
        targets: &[u32],
        out: &mut CudaTensor,
    ) -> EResult<()> {
        let dims = ((logits.rows, logits.cols), (out.rows, out.cols));
        check_logprob_terms("cuda", dims.0, targets, dims.1)?;
        Ok(self.logprob_rows(logits, targets, out)?)
    }

    fn softmax_totals(
        &self,
        logits: &CudaTensor,
        temperatures: &[f32],
        out: &mut CudaTensor,
    ) -> EResult<()> {
        check_softmax_totals("cuda", logits.rows, temperatures, (out.rows, out.cols))?;
        Ok(self.total_rows(logits, temperatures, out)?)
    }

    fn pick_logits(
        &self,
        logits: &CudaTensor,
        picks: &[(u32, u32)],
        out: &mut CudaTensor,
    ) -> EResult<()> {
        let dims = ((logits.rows, logits.cols), (out.rows, out.cols));
        check_pick_logits("cuda", dims.0, picks, dims.1)?;
        Ok(self.pick_rows(logits, picks, out)?)
    }

    fn walk_tails(
        &self,
        logits: &CudaTensor,
        walks: &[(usize, &TailWalk)],
        out: &mut CudaTensor,
    ) -> EResult<()> {
        let dims = ((logits.rows, logits.cols), (out.rows, out.cols));
        check_walk_tails("cuda", dims.0, walks, dims.1)?;
        Ok(self.walk_rows(logits, walks, out)?)
    }

    fn set_logits(
        &self,
        logits: &mut CudaTensor,
        places: &[(u32, u32)],
        value: f32,
    ) -> EResult<()> {
        check_logit_places("cuda", "set_logits", (logits.rows, logits.cols), places)?;
        Ok(self.set_places(logits, places, value)?)
    }

    fn product_rows(&self, rows: usize) -> usize {
        product_rows(rows)
    }

    fn tune_products(&self, on: bool) -> EResult<()> {
        Ok(CudaBackend::tune_products(self, on)?)
    }

    fn product_choices(&self) -> EResult<Vec<u8>> {
        Ok(CudaBackend::product_choices(self)?)
    }

    fn adopt_product_choices(&self, choices: &[u8]) -> EResult<()> {
        Ok(CudaBackend::adopt_product_choices(self, choices)?)
    }

    fn graph_epoch(&self) -> Option<u64> {
        Some(self.graph_epoch_now())
    }

    fn stage_step(&self, ids: &[u32], positions: &[u32], stores: &[(u32, u32)]) -> EResult<()> {
        self.upload_step_input(StepInput::Ids, ids)?;
        self.upload_step_input(StepInput::Positions, positions)?;
        self.upload_step_input(StepInput::Slots, &slot_pairs(stores))?;
        Ok(())
    }

    fn begin_capture(&self) -> EResult<()> {
        Ok(CudaBackend::begin_capture(self)?)
    }

    fn end_capture(&self) -> EResult<crate::CudaGraph> {
        Ok(CudaBackend::end_capture(self)?)
    }

    fn replay(&self, graph: &crate::CudaGraph) -> EResult<()> {
        Ok(CudaBackend::replay(self, graph)?)
    }
}
