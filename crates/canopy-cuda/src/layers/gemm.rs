//! The dense layers' GEMMs: `out = x · wᵀ` (or `out += x · wᵀ`) with fp32 activations and
//! weights in their stored dtype. A product of at most [`GEMV_MAX_ROWS`] rows (a decode step)
//! is `gemv.cu`'s `gemv`, which streams the weight once at close to the memory's bandwidth
//! (on the tensor cores for a 16-bit weight) and folds the residual add or SwiGLU into its
//! output; more rows (a prefill) run on cuBLAS. The GEMV is an ordinary launch, after the
//! kernel before it; its split of k over warps is chosen from the kernel's occupancy, the most
//! warps that all run at once.
//!
//! A 16-bit weight multiplies its activation rounded to the same dtype and accumulates in fp32
//! into an fp32 output, as a model's bf16 GEMMs do; the gate|up product that SwiGLU reads is
//! stored in the weight's dtype instead. The rounded copy is the one the op that
//! wrote the activation made beside it (a GEMM operand, see `CudaTensor`), or else a small
//! kernel writes it into a scratch buffer kept between calls. An f32 weight runs in pedantic fp32: neither TF32
//! nor cuBLAS's bf16 emulation of fp32 may round its operands.
//!
//! cuBLAS sets each new shape up the first time it runs it: a heuristic search for its kernel
//! (tens of microseconds of the host's time) and, for a kernel not yet run, its module's load
//! (2.5-4 ms). A server's passes with prompt chunks have row counts that change every step, so
//! a product of more than [`EXACT_PRODUCT_ROWS`] rows runs at the next of a few counts
//! ([`product_rows`]), which a server warms up before it serves: activations hold that many
//! rows, and the padding rows' products are computed and never read.
//!
//! cuBLAS is column-major. A row-major `[r × c]` matrix is the column-major `[c × r]` one, so
//! the row-major `out[rows × n] = x[rows × k] · w[n × k]ᵀ` is, column-major,
//! `outᶜ[n × rows] = op_T(wᶜ[k × n]) · xᶜ[k × rows]`: A is `w` transposed (lda = k), B is `x`
//! as it is (ldb = k), C is `out` (ldc = n).

use super::tuning::{ProductPtrs, ProductShape, Tuning};
use super::{CudaTensor, CudaWeight};
use crate::backend::CudaBackend;
use crate::error::{CudaError, DriverContext, Result};
use crate::launch::Params;
use canopy_core::DType;
use canopy_engine::layer_ops::expect_size;
use canopy_kernels::{
    Kernel, GEMV_COLS, GEMV_MAX_ROWS, GEMV_WARPS, LAYER_THREADS, NORMED_GEMV_ROWS, RMS_NORM_CHUNKS,
};
use cudarc::cublas::result::CublasError;
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::cublas::CudaBlas;
use cudarc::driver::{
    CudaFunction, CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, MutexGuard};

/// The backend's dense-layer state: one cuBLAS handle on the backend's stream and the
/// rounded-activation scratch, both made on first use (a backend that never runs a model
/// never loads cuBLAS), the GEMV kernels' occupancy and the step inputs last uploaded. One
/// lock covers handle and scratch, so a GEMM's scratch is not rewritten by another thread's
/// before cuBLAS has read it (one stream orders the device side).
#[derive(Default)]
pub(crate) struct LayerState {
    gemm: Mutex<Option<Gemm>>,
    /// CTAs of each GEMV kernel (with its dynamic shared memory) that fit on one SM at once.
    gemv_ctas_per_sm: Mutex<HashMap<(Kernel, u32), u32>>,
    /// The last upload of each [`StepInput`]: every layer of a step passes the same one.
    step_inputs: Mutex<HashMap<StepInput, Uploaded>>,
}

/// The least elements a step input buffer holds: a decode step's rows fit without growing.
const STEP_INPUT_MIN: usize = 256;

/// A host array and its copy on the device (the buffer may be longer).
type Uploaded = (Vec<u32>, Arc<CudaSlice<u32>>);

/// Per-step (or per-pass) arrays every layer uploads: uploaded once while they stay the same,
/// so the layers' kernels follow one another with no copy between them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum StepInput {
    /// The rows' token ids, for the embedding.
    Ids,
    /// The rows' positions, for RoPE and as a chunked prefill's query positions.
    Positions,
    /// A block's query positions
    /// ([`LayerOps::causal_attention_from`](canopy_engine::LayerOps::causal_attention_from)):
    /// a pass of several chunks numbers its rows apart from RoPE's positions.
    BlockPositions,
    /// The first key position each of a block's query rows sees, where the rows have windows.
    BlockFrom,
    /// (row, slot) pairs, for the KV store.
    Slots,
    /// The positions of the keys a prefill's attention reads.
    KeyPositions,
    /// The cache slots of the keys a prefill's attention reads.
    KeySlots,
    /// The rows an activation gather reads, where they run in many pieces.
    GatherRows,
    /// The rows a states gather reads, where they run in many pieces.
    StateRows,
}

impl StepInput {
    /// Whether a recorded decode pass reads this input: the ones
    /// [`LayerOps::stage_step`](canopy_engine::LayerOps::stage_step) stages before a pass is
    /// recorded. The others are read by a prefill's attention alone, which is never recorded,
    /// so their buffers may be made anew without making the recordings stale.
    fn read_by_recordings(self) -> bool {
        matches!(
            self,
            StepInput::Ids | StepInput::Positions | StepInput::Slots
        )
    }
}

/// Where a GEMM writes its `rows × n` product.
pub(crate) enum Product<'a> {
    /// fp32 elements: stored, or added to.
    F32(&'a mut CudaSlice<f32>),
    /// Elements of the weight's 16-bit dtype, stored (rounded from the fp32 sums).
    Narrow(&'a mut CudaSlice<u16>),
}

/// A gate|up product for `swiglu`: an fp32 activation, or elements of a 16-bit dtype.
pub(crate) enum GateUp<'a> {
    F32(&'a CudaTensor),
    Narrow(&'a CudaSlice<u16>, DType),
}

struct Gemm {
    blas: CudaBlas,
    scratch: Option<CudaSlice<u16>>,
    /// Made when timing starts or another backend's choices are adopted.
    tuning: Option<Tuning>,
}

/// Whether libcublas can be loaded (never panics: cudarc panics on first use otherwise).
pub(crate) fn cublas_present() -> bool {
    // SAFETY: only tries to dlopen the library.
    unsafe { cudarc::cublas::sys::is_culib_present() }
}

pub(super) fn no_cublas() -> CudaError {
    CudaError::Unsupported(
        "cuBLAS (libcublas.so and libcublasLt.so) could not be loaded; add the CUDA toolkit's lib folder (e.g. /usr/local/cuda/lib64) to LD_LIBRARY_PATH".into(),
    )
}

fn cublas_failed(call: &str, e: CublasError) -> CudaError {
    CudaError::Unsupported(format!(
        "cuBLAS {call} failed ({e}); check that the GPU supports the weights' dtype (bf16 needs compute capability 8.0 or later) and that the CUDA toolkit matches the driver"
    ))
}

fn cuda_type(dtype: DType) -> cudaDataType {
    match dtype {
        DType::F32 => cudaDataType::CUDA_R_32F,
        DType::F16 => cudaDataType::CUDA_R_16F,
        DType::Bf16 => cudaDataType::CUDA_R_16BF,
    }
}

/// A GEMM dimension as cuBLAS's `int`.
fn dim(what: &str, n: usize) -> Result<i32> {
    i32::try_from(n).map_err(|_| {
        CudaError::Unsupported(format!(
            "matmul: {what} of {n} is past cuBLAS's 32-bit dimensions; split the matrix"
        ))
    })
}

/// What a product does with its output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Epilogue {
    /// `out = x · wᵀ`.
    Store,
    /// `out += x · wᵀ`.
    Add,
    /// `out = silu(x · gateᵀ) * (x · upᵀ)`, `w` holding gate's rows then up's.
    Swiglu,
}

impl Epilogue {
    /// The `LayerOps` op that runs this product.
    fn op(self) -> &'static str {
        match self {
            Epilogue::Store => "matmul",
            Epilogue::Add => "matmul_add",
            Epilogue::Swiglu => "matmul_swiglu",
        }
    }

    /// The GEMV's entry point, normalising its activation rows as it reads them when `normed`.
    fn gemv_entry(self, normed: bool) -> &'static str {
        match (self, normed) {
            (Epilogue::Store, false) => "gemv",
            (Epilogue::Add, _) => "gemv_add",
            (Epilogue::Swiglu, false) => "gemv_swiglu",
            (Epilogue::Store, true) => "gemv_normed",
            (Epilogue::Swiglu, true) => "gemv_normed_swiglu",
        }
    }

    /// Refuses a product whose operands do not fit: `w` as wide as `x` (`rows × cols`), `out`
    /// as many rows as `x` and as wide as `w` has rows (half of them, gate's then up's, for
    /// SwiGLU).
    pub(crate) fn check(
        self,
        (rows, cols): (usize, usize),
        w: &CudaWeight,
        out: &CudaTensor,
    ) -> Result<()> {
        let op = self.op();
        expect_size("cuda", op, "the weight's columns", w.cols, cols)?;
        let width = match self {
            Epilogue::Swiglu if !w.rows.is_multiple_of(2) => {
                return Err(CudaError::Unsupported(format!(
                    "{op}: a fused gate|up weight has an even number of rows, not {}",
                    w.rows
                )))
            }
            Epilogue::Swiglu => w.rows / 2,
            Epilogue::Store | Epilogue::Add => w.rows,
        };
        super::same_dims(op, "the output", out, (rows, width))
    }
}

/// Most bytes of normalised rows a normed GEMV stages in shared memory: within the 48 KiB a
/// kernel gets without opting in, and few enough that three CTAs still share an SM.
const NORMED_STAGE_BYTES: usize = 16 << 10;

/// Whether the GEMV of `x` and `w` can normalise x's rows by `norm` itself (`gemv_normed`):
/// at most [`NORMED_GEMV_ROWS`] rows that `rms_norm` holds whole, staged within
/// [`NORMED_STAGE_BYTES`], and a norm weight of the weight's dtype.
pub(crate) fn gemv_normalises(x: &CudaTensor, norm: &CudaWeight, w: &CudaWeight) -> bool {
    x.cols.is_multiple_of(4)
        && x.cols <= 4 * LAYER_THREADS as usize * RMS_NORM_CHUNKS
        && x.rows * x.cols * w.dtype.size_bytes() <= NORMED_STAGE_BYTES
        && x.rows <= NORMED_GEMV_ROWS
        && norm.dtype == w.dtype
        && gemv_fits(x.rows, x.cols, w)
}

/// Dynamic shared memory of a GEMV of `x` and `w`: a normed GEMV stages its rows, normalised.
pub(crate) fn gemv_staged(x: GemvRows<'_>, w: &CudaWeight, normed: bool) -> Result<u32> {
    let staged = if normed {
        x.rows * x.cols * w.dtype.size_bytes()
    } else {
        0
    };
    super::narrow("matmul", staged)
}

/// A GEMV's activation: `rows × cols` fp32 values, a tensor's or a states' outputs.
#[derive(Clone, Copy)]
pub(crate) struct GemvRows<'a> {
    pub(crate) values: &'a CudaSlice<f32>,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
}

impl<'a> GemvRows<'a> {
    pub(crate) fn of(x: &'a CudaTensor) -> Result<Self> {
        Ok(GemvRows {
            values: x.values("matmul")?,
            rows: x.rows,
            cols: x.cols,
        })
    }
}

/// Whether `gemv` takes a product of `rows × cols` activations: few rows for the weight's
/// size ([`gemv_takes_rows`]), and rows of the weight and of the activation that start on
/// 16-byte boundaries (its loads are 16 bytes wide).
pub(crate) fn gemv_fits(rows: usize, cols: usize, w: &CudaWeight) -> bool {
    let chunk = 16 / w.dtype.size_bytes();
    gemv_takes_rows(rows, w.rows * w.cols * w.dtype.size_bytes())
        && cols.is_multiple_of(chunk)
        && cols.is_multiple_of(4)
}

/// Rows up to which the GEMV takes a product of any weight.
const GEMV_ANY_WEIGHT_ROWS: usize = 2;

/// The largest weight (bytes) the GEMV takes at more rows than [`GEMV_ANY_WEIGHT_ROWS`].
const GEMV_SMALL_WEIGHT_BYTES: usize = 16 << 20;

/// Whether the GEMV takes `rows` rows of a product with a weight of `weight_bytes` (else
/// cuBLAS does). Each of its warps reads every row's activation for its eight columns, so its
/// time grows with the rows by a share of the weight's streaming time, while cuBLAS's time
/// hardly does; cuBLAS costs instead the launches the GEMV's epilogues spare (RMSNorm, RoPE,
/// SwiGLU, the split-k reduction), a few microseconds a product. So the GEMV keeps one or two
/// rows of any weight, and up to [`GEMV_MAX_ROWS`] of a weight whose stream is about as short
/// as those launches. On an H200, replayed passes of 4 and 8 rows took 14-17% less time on
/// the GEMV than on cuBLAS for SmolLM2-135M (weights of at most 3.5 MB), and 12-24% more for
/// Llama-3.1-8B (33-235 MB), 8% more at 3 rows (BENCHMARKS, session 48).
fn gemv_takes_rows(rows: usize, weight_bytes: usize) -> bool {
    rows <= GEMV_ANY_WEIGHT_ROWS
        || (rows <= GEMV_MAX_ROWS && weight_bytes <= GEMV_SMALL_WEIGHT_BYTES)
}

/// Rows up to which a product runs at its own row count: a server's decode batches, each
/// warmed up.
const EXACT_PRODUCT_ROWS: usize = 64;

/// Counts a product's rows are padded to in each doubling above [`EXACT_PRODUCT_ROWS`], in
/// steps of at least [`EXACT_PRODUCT_ROWS`] rows: the padding is under 64 rows up to 4,096
/// rows, and under a 32nd of the rows from 2,048 rows up, where products are bound by their
/// arithmetic and a padding row costs what a real one does.
const PRODUCT_COUNTS_PER_DOUBLING: usize = 32;

/// The rows a product of `rows` rows runs at: `rows` up to [`EXACT_PRODUCT_ROWS`], else the
/// next of [`PRODUCT_COUNTS_PER_DOUBLING`] even steps from half the power of two at or above
/// `rows` to it, steps of at least [`EXACT_PRODUCT_ROWS`]: 128, 192, 256, 320, …, 4,096,
/// 4,224, …, 8,192, 8,448, ….
pub(crate) fn product_rows(rows: usize) -> usize {
    if rows <= EXACT_PRODUCT_ROWS {
        return rows;
    }
    let doubling = rows.next_power_of_two() / 2;
    rows.next_multiple_of((doubling / PRODUCT_COUNTS_PER_DOUBLING).max(EXACT_PRODUCT_ROWS))
}

/// The elements of a `rows × cols` activation: the rows its products run at
/// ([`product_rows`]), so that a product may read and write the padding rows.
pub(crate) fn activation_len(rows: usize, cols: usize) -> usize {
    product_rows(rows) * cols
}

impl CudaBackend {
    /// [`CudaBackend::product`] of operands checked to fit.
    pub(crate) fn checked_product(
        &self,
        x: &CudaTensor,
        w: &CudaWeight,
        out: &mut CudaTensor,
        epilogue: Epilogue,
    ) -> Result<()> {
        epilogue.check((x.rows, x.cols), w, out)?;
        self.product(x, w, out, epilogue)
    }

    /// `epilogue`'s product of x RMS-normalised by `norm` (its weight and epsilon): one
    /// `gemv_normed` launch, whose CTAs each normalise x's rows into their shared memory (the
    /// same bits as `rms_norm` then the GEMV), where the GEMV takes the product, x has at
    /// most [`NORMED_GEMV_ROWS`] rows that `rms_norm` holds whole and the norm's weight is in
    /// the weight's dtype; else `rms_norm` into `normed`, then the product of it.
    pub(crate) fn normed_product(
        &self,
        x: &CudaTensor,
        (norm, eps): (&CudaWeight, f32),
        w: &CudaWeight,
        normed: &mut CudaTensor,
        out: &mut CudaTensor,
        epilogue: Epilogue,
    ) -> Result<()> {
        let fused = epilogue != Epilogue::Add && gemv_normalises(x, norm, w);
        if !fused || x.rows == 0 || x.cols == 0 || w.rows == 0 {
            self.rms_norm_rows(x, norm, eps, normed)?;
            return self.checked_product(normed, w, out, epilogue);
        }
        super::check_norm_weight(x, norm)?;
        epilogue.check((x.rows, x.cols), w, out)?;
        out.drop_rounded();
        self.gemv(GemvRows::of(x)?, w, Some((norm, eps)), out, epilogue)
    }

    /// The product `x · wᵀ` into `out` by `epilogue` (shapes checked by the caller): see the
    /// module notes.
    pub(crate) fn product(
        &self,
        x: &CudaTensor,
        w: &CudaWeight,
        out: &mut CudaTensor,
        epilogue: Epilogue,
    ) -> Result<()> {
        out.drop_rounded();
        if x.rows == 0 || w.rows == 0 {
            return Ok(());
        }
        if gemv_fits(x.rows, x.cols, w) && x.cols > 0 {
            return self.gemv(GemvRows::of(x)?, w, None, out, epilogue);
        }
        match epilogue {
            Epilogue::Store => self.gemm(x, w, Product::F32(&mut out.data), false),
            Epilogue::Add => self.gemm(x, w, Product::F32(&mut out.data), true),
            // A 16-bit weight's gate|up product is held in its dtype, as a 16-bit model's is:
            // half the bytes written and read back of the widest activation of a layer.
            Epilogue::Swiglu if w.dtype != DType::F32 => {
                let mut gate_up = self.alloc::<u16>(activation_len(x.rows, w.rows))?;
                self.gemm(x, w, Product::Narrow(&mut gate_up), false)?;
                self.swiglu_halves(GateUp::Narrow(&gate_up, w.dtype), out)
            }
            Epilogue::Swiglu => {
                let mut gate_up = self.tensor_of(x.rows, w.rows)?;
                self.gemm(x, w, Product::F32(&mut gate_up.data), false)?;
                self.swiglu_halves(GateUp::F32(&gate_up), out)
            }
        }
    }

    /// `gemv.cu`'s GEMV for `epilogue`, normalising x's rows by `norm` (its weight and
    /// epsilon) as it reads them when there is one.
    pub(crate) fn gemv(
        &self,
        x: GemvRows<'_>,
        w: &CudaWeight,
        norm: Option<(&CudaWeight, f32)>,
        out: &mut CudaTensor,
        epilogue: Epilogue,
    ) -> Result<()> {
        let (rows, cols, k) = (
            super::narrow("matmul", x.rows)?,
            super::narrow("matmul", out.cols)?,
            super::narrow("matmul", x.cols)?,
        );
        let entry = epilogue.gemv_entry(norm.is_some());
        let kernel = Kernel::Layers(w.dtype, entry);
        let f = self.function(kernel)?;
        let groups = cols.div_ceil(GEMV_COLS);
        let staged = gemv_staged(x, w, norm.is_some())?;
        let slices = self.gemv_slices(kernel, &f, groups, staged)?;
        let s = &self.stream;
        let mut params = Params::default().buffer(&w.data, s).buffer(x.values, s);
        if let Some((norm, eps)) = norm {
            params = params.buffer(&norm.data, s).f32(eps);
        }
        let params = params
            .buffer(&out.data, s)
            .u32(rows)
            .u32(cols)
            .u32(k)
            .u32(slices);
        let cfg = LaunchConfig {
            grid_dim: (groups.div_ceil(GEMV_WARPS / slices), 1, 1),
            block_dim: (GEMV_WARPS * 32, 1, 1),
            shared_mem_bytes: staged,
        };
        // SAFETY: w holds (cols, or 2 · cols for SwiGLU) × k elements of its dtype, x rows × k
        // floats, the norm's weight (if any) k elements of w's dtype, and out rows × cols (the
        // caller checked the shapes); k is a whole number of 16-byte chunks of both
        // (gemv_fits) and device allocations are 256-byte aligned. The GEMV starts once the
        // kernel before it has finished: as a programmatic dependent, whose CTAs wait on SM
        // slots beside that kernel's, decode steps were 1-3% slower (BENCHMARKS, session 31).
        unsafe { self.launch_params(&f, cfg, &params, false) }.ctx(format!("launching {entry}"))?;
        Ok(())
    }

    /// `host` on the device, in `input`'s buffer: nothing to copy when `host` is what it
    /// holds, else written in place when it fits and no op holds the buffer, else a larger
    /// one. One stream orders the writes after the kernels queued before that read the buffer.
    pub(crate) fn upload_step_input(
        &self,
        input: StepInput,
        host: &[u32],
    ) -> Result<Arc<CudaSlice<u32>>> {
        let mut last = self
            .layers
            .step_inputs
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if !input.read_by_recordings() {
            // Even unchanged, its buffer's address would be baked into the recording.
            self.refuse_while_capturing("a prefill's step input")?;
        }
        let fits = match last.get_mut(&input) {
            Some((held, device)) if held.as_slice() == host => return Ok(device.clone()),
            Some((_, device)) => Arc::get_mut(device).is_some_and(|b| b.len() >= host.len()),
            None => false,
        };
        self.refuse_while_capturing("a step input not staged")?;
        if !fits {
            if input.read_by_recordings() {
                self.renew("a step input buffer")?;
            }
            let len = host.len().next_power_of_two().max(STEP_INPUT_MIN);
            last.insert(input, (Vec::new(), Arc::new(self.alloc::<u32>(len)?)));
        }
        let (held, device) = last.get_mut(&input).expect("inserted above");
        let buffer = Arc::get_mut(device).expect("no op holds it");
        if !host.is_empty() {
            self.stream
                .memcpy_htod(host, &mut buffer.slice_mut(..host.len()))
                .ctx("cuMemcpyHtoD")?;
        }
        held.clear();
        held.extend_from_slice(host);
        Ok(device.clone())
    }

    /// Warps per group of GEMV_COLS columns of a GEMV of `groups` groups: the most whose CTAs
    /// all run at once, so every warp the GPU can hold streams part of the weight and none
    /// waits for a second wave.
    pub(crate) fn gemv_slices(
        &self,
        kernel: Kernel,
        f: &CudaFunction,
        groups: u32,
        staged: u32,
    ) -> Result<u32> {
        let wave = self.gpu.multiprocessors * self.gemv_ctas_per_sm(kernel, f, staged)?;
        Ok([GEMV_WARPS, 4, 2]
            .into_iter()
            .find(|&s| groups.div_ceil(GEMV_WARPS / s) <= wave)
            .unwrap_or(1))
    }

    /// CTAs of GEMV `kernel` (loaded as `f`) that fit on one SM at once, queried once.
    fn gemv_ctas_per_sm(&self, kernel: Kernel, f: &CudaFunction, shared: u32) -> Result<u32> {
        let mut known = self
            .layers
            .gemv_ctas_per_sm
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(&n) = known.get(&(kernel, shared)) {
            return Ok(n);
        }
        let n = f
            .occupancy_max_active_blocks_per_multiprocessor(GEMV_WARPS * 32, shared as usize, None)
            .ctx("cuOccupancyMaxActiveBlocksPerMultiprocessor")?
            .max(1);
        known.insert((kernel, shared), n);
        Ok(n)
    }

    /// The GEMM state, cuBLAS's handle made on first use.
    fn gemm_state(&self) -> Result<MutexGuard<'_, Option<Gemm>>> {
        let mut guard = self.layers.gemm.lock().unwrap_or_else(|p| p.into_inner());
        if guard.is_none() {
            if !cublas_present() {
                return Err(no_cublas());
            }
            let blas =
                CudaBlas::new(self.stream.clone()).map_err(|e| cublas_failed("cublasCreate", e))?;
            *guard = Some(Gemm {
                blas,
                scratch: None,
                tuning: None,
            });
        }
        Ok(guard)
    }

    /// The tuning state ([`Tuning`]), made on first use.
    fn with_tuning<T>(&self, f: impl FnOnce(&mut Tuning) -> Result<T>) -> Result<T> {
        let mut guard = self.gemm_state()?;
        let gemm = guard.as_mut().expect("made by gemm_state");
        if gemm.tuning.is_none() {
            gemm.tuning = Some(Tuning::new(self)?);
        }
        f(gemm.tuning.as_mut().expect("made above"))
    }

    /// [`LayerOps::tune_products`](canopy_engine::LayerOps::tune_products): timing stops with
    /// the buffer that evicts L2 between runs (four times the L2) freed.
    pub(crate) fn tune_products(&self, on: bool) -> Result<()> {
        self.with_tuning(|t| {
            t.on = on;
            Ok(())
        })?;
        if !on {
            *self.flush.lock().unwrap_or_else(|p| p.into_inner()) = None;
        }
        Ok(())
    }

    pub(crate) fn product_choices(&self) -> Result<Vec<u8>> {
        self.with_tuning(|t| t.choices())
    }

    pub(crate) fn adopt_product_choices(&self, choices: &[u8]) -> Result<()> {
        self.with_tuning(|t| t.adopt(choices))
    }

    /// `out = x · wᵀ`, or `out += x · wᵀ` when `accumulate`, on cuBLAS.
    fn gemm(
        &self,
        x: &CudaTensor,
        w: &CudaWeight,
        mut out: Product,
        accumulate: bool,
    ) -> Result<()> {
        let (rows, k, n) = (x.rows, x.cols, w.rows);
        if k == 0 && accumulate {
            return Ok(());
        }
        if k == 0 {
            // An empty sum (cuBLAS refuses a leading dimension of 0).
            let zeroed = match &mut out {
                Product::F32(c) => self.stream.memset_zeros(*c),
                Product::Narrow(c) => self.stream.memset_zeros(*c),
            };
            return zeroed.ctx("cuMemsetD8Async");
        }
        let padded = product_rows(rows);
        let mut guard = self.gemm_state()?;
        let gemm = guard.as_mut().expect("made by gemm_state");
        let s = &self.stream;
        // The activation operand: x itself for f32 weights, else x's rounded copy where the op
        // that wrote x made one, else x rounded into the scratch; with the rows it holds.
        let (b_ptr, b_rows, compute) = match (w.dtype, x.rounded_to(w.dtype)) {
            (DType::F32, _) => {
                let values = x.values("matmul")?;
                (
                    values.device_ptr(s).0,
                    values.len() / k,
                    cublasComputeType_t::CUBLAS_COMPUTE_32F_PEDANTIC,
                )
            }
            (_, Some(rounded)) => (
                rounded.device_ptr(s).0,
                rounded.len() / k,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
            ),
            (DType::F16 | DType::Bf16, None) => {
                let len = rows * k;
                let scratch = match gemm.scratch.take() {
                    Some(kept) if kept.len() >= padded * k => kept,
                    // Freed (stream-ordered) before its larger replacement is allocated.
                    small => {
                        self.renew("a GEMM scratch")?;
                        drop(small);
                        self.alloc::<u16>(padded * k)?
                    }
                };
                let scratch = gemm.scratch.insert(scratch);
                let f = self.function(Kernel::Layers(w.dtype, "round_to_elem"))?;
                let (len, no_copy) = (len as u64, 0u64);
                let mut b = s.launch_builder(&f);
                b.arg(x.values("matmul")?)
                    .arg(&no_copy)
                    .arg(&mut *scratch)
                    .arg(&len);
                // SAFETY: reads `len` floats of x and writes `len` elements of the scratch,
                // which holds at least that many.
                unsafe { b.launch(self.elementwise(len as usize)) }
                    .ctx("launching round_to_elem")?;
                (
                    scratch.device_ptr(s).0,
                    scratch.len() / k,
                    cublasComputeType_t::CUBLAS_COMPUTE_32F,
                )
            }
        };
        let (alpha, beta) = (1.0f32, if accumulate { 1.0f32 } else { 0.0 });
        let (a_ptr, _) = w.data.device_ptr(s);
        let (c_rows, c_ptr, c_type) = match &mut out {
            Product::F32(c) => (c.len() / n, c.device_ptr_mut(s).0, cudaDataType::CUDA_R_32F),
            Product::Narrow(c) => (c.len() / n, c.device_ptr_mut(s).0, cuda_type(w.dtype)),
        };
        // Padded where both operands hold the padding rows (activations are made so).
        let run_rows = match b_rows.min(c_rows) >= padded {
            true => padded,
            false => rows,
        };
        let (m_, n_, k_) = (
            dim("a weight's rows", n)?,
            dim("rows", run_rows)?,
            dim("width", k)?,
        );
        self.ctx.bind_to_thread().ctx("cuCtxSetCurrent")?;
        let narrow = matches!(out, Product::Narrow(_));
        let Gemm { blas, tuning, .. } = gemm;
        // `cublasGemmEx`'s pick, into the output at `c`.
        let mut default = |c: u64| {
            // SAFETY: A is w's n × k elements of its dtype, B is run_rows × k elements of the
            // same dtype (x or its rounded copy), C is run_rows × n floats or elements of w's
            // dtype (the output or a scratch of its size): the leading dimensions and sizes of
            // the module notes, within the buffers (the caller checked the shapes for `rows`,
            // and B and C hold `run_rows` rows, counted above). alpha and beta are host
            // floats, cuBLAS's default pointer mode and the scale type of a 32F compute type.
            unsafe {
                cudarc::cublas::result::gemm_ex(
                    *blas.handle(),
                    cublasOperation_t::CUBLAS_OP_T,
                    cublasOperation_t::CUBLAS_OP_N,
                    m_,
                    n_,
                    k_,
                    &alpha as *const f32 as *const c_void,
                    a_ptr as *const c_void,
                    cuda_type(w.dtype),
                    k_,
                    b_ptr as *const c_void,
                    cuda_type(w.dtype),
                    k_,
                    &beta as *const f32 as *const c_void,
                    c as *mut c_void,
                    c_type,
                    m_,
                    compute,
                    cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }
            .map_err(|e| cublas_failed("cublasGemmEx", e))
        };
        let shape = ProductShape {
            dtype: w.dtype,
            narrow,
            n: m_,
            rows: n_,
            k: k_,
            accumulate,
        };
        if let Some(tuning) = tuning.as_mut().filter(|_| shape.tuned()) {
            let ptrs = ProductPtrs {
                a: a_ptr,
                b: b_ptr,
                c: c_ptr,
            };
            if tuning.on && !tuning.knows(&shape) {
                self.refuse_while_capturing("timing a product's algorithms")?;
                tuning.tune(self, shape, ptrs, &mut default);
            }
            if tuning.run(self, &shape, ptrs)? {
                return Ok(());
            }
        }
        default(c_ptr)
    }
}

#[cfg(test)]
mod tests {
    use super::{gemv_takes_rows, product_rows, EXACT_PRODUCT_ROWS, GEMV_MAX_ROWS};

    const MIB: usize = 1 << 20;

    /// Llama-3.1-8B's smallest bf16 weight (o, 32 MiB) and SmolLM2-135M's largest (gate|up,
    /// 3.4 MiB).
    #[test]
    fn the_gemv_keeps_few_rows_of_a_large_weight_and_more_of_a_small_one() {
        for rows in 1..=2 {
            assert!(gemv_takes_rows(rows, 32 * MIB));
        }
        assert!(!gemv_takes_rows(3, 32 * MIB));
        assert!(gemv_takes_rows(GEMV_MAX_ROWS, 3 * MIB + MIB / 2));
        assert!(!gemv_takes_rows(GEMV_MAX_ROWS + 1, 3 * MIB));
    }

    #[test]
    fn products_run_at_a_few_row_counts_padded_by_under_a_32nd_from_2048() {
        for rows in 0..=EXACT_PRODUCT_ROWS {
            assert_eq!(product_rows(rows), rows);
        }
        assert_eq!(product_rows(65), 128);
        assert_eq!(product_rows(137), 192);
        assert_eq!(product_rows(2049), 2112);
        assert_eq!(product_rows(4097), 4224);
        assert_eq!(product_rows(8192), 8192);
        assert_eq!(product_rows(8193), 8448);
        let mut counts = Vec::new();
        for rows in 1..=20_000 {
            let run = product_rows(rows);
            assert!(run >= rows);
            if rows <= 4096 {
                assert!(run - rows < EXACT_PRODUCT_ROWS, "{rows} rows run at {run}");
            }
            assert_eq!(product_rows(run), run, "a padded count is its own");
            if rows >= 2048 {
                assert!(run - rows < rows / 32, "{rows} rows run at {run}");
            }
            if counts.last() != Some(&run) {
                counts.push(run);
            }
        }
        // Every batch up to the exact rows, steps of 64 to 4,096, then 32 counts a doubling
        // (8 of the last, to 20,480).
        assert_eq!(counts.len(), EXACT_PRODUCT_ROWS + 31 + 32 + 32 * 2 + 8);
    }
}
