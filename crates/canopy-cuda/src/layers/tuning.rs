//! Each dense product shape run the fastest way cuBLAS offers, timed once.
//!
//! `cublasGemmEx` runs a product with the kernel its heuristic picks for the shape, and at a
//! server's decode row counts that pick is often not the fastest on offer: on an H200, the 8B
//! output projection took 15-16 µs at 33-40 rows where another of cuBLASLt's algorithms took
//! 12.5, and gate|up and down 1.5-3.5 µs more a layer at 48-64 rows (BENCHMARKS, session 65).
//! Which one wins depends on the GPU, the library and the shape, so it is measured: while
//! tuning is on ([`LayerOps::tune_products`], a server's warm-up), a product of a new shape of
//! at most [`TUNED_ROWS`] rows is timed with `cublasGemmEx` and with each algorithm cuBLASLt's
//! heuristic offers, each run with its weight out of L2 as a pass meets it, into a scratch
//! output. From then on the shape runs the fastest way. At a prefill's thousands of rows the
//! heuristic's pick was as fast as any offered (session 47), so those shapes are not timed.
//!
//! A choice changes a product's bits, and every rank of a model must compute the same bits
//! so that each draws the same tokens: one rank times, and the others adopt its choices
//! ([`LayerOps::product_choices`]), each algorithm checked by cuBLASLt on their own GPU.
//!
//! [`LayerOps::tune_products`]: canopy_engine::LayerOps::tune_products
//! [`LayerOps::product_choices`]: canopy_engine::LayerOps::product_choices

use crate::backend::CudaBackend;
use crate::error::{CudaError, DriverContext, Result};
use canopy_core::DType;
use cudarc::cublaslt::result::CublasError;
use cudarc::cublaslt::sys as lt;
use cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
use cudarc::driver::{CudaSlice, DevicePtrMut};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::ffi::c_void;

/// Products of at most this many rows are timed; larger ones run as `cublasGemmEx` picks.
const TUNED_ROWS: usize = 256;
/// Algorithms of cuBLASLt's heuristic timed against `cublasGemmEx`'s pick.
const CANDIDATES: usize = 8;
/// Timed runs of each candidate, after one that loads its kernel; the median counts.
const TIMED_RUNS: usize = 3;
/// An algorithm replaces `cublasGemmEx`'s pick only if faster by this fraction: within it,
/// the runs' spread would decide more than the algorithm.
const MARGIN: f64 = 0.02;
/// cuBLASLt's workspace, as its heuristic is told (split-K's partial sums live there).
const WORKSPACE_BYTES: usize = 32 << 20;

/// A product as cuBLAS runs it (column-major, see `gemm.rs`): `out[n × rows] = op_T(w[k ×
/// n]) · x[k × rows]` (`+ out` where `accumulate`), its output fp32 or, where `narrow`, in
/// the weight's 16-bit dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub(crate) struct ProductShape {
    pub(crate) dtype: DType,
    pub(crate) narrow: bool,
    pub(crate) n: i32,
    pub(crate) rows: i32,
    pub(crate) k: i32,
    pub(crate) accumulate: bool,
}

impl ProductShape {
    /// Whether this shape is timed: a 16-bit weight (an f32 weight runs in pedantic fp32,
    /// which cuBLASLt's algorithms do not) of at most [`TUNED_ROWS`] rows.
    pub(crate) fn tuned(&self) -> bool {
        self.dtype != DType::F32 && self.rows as usize <= TUNED_ROWS
    }

    fn elem_type(&self) -> lt::cudaDataType {
        match self.dtype {
            DType::F16 => lt::cudaDataType::CUDA_R_16F,
            _ => lt::cudaDataType::CUDA_R_16BF,
        }
    }

    fn out_type(&self) -> lt::cudaDataType {
        match self.narrow {
            true => self.elem_type(),
            false => lt::cudaDataType::CUDA_R_32F,
        }
    }

    /// Bytes of the weight.
    fn weight_bytes(&self) -> usize {
        self.n as usize * self.k as usize * 2
    }

    /// Bytes of the output.
    fn out_bytes(&self) -> usize {
        let elem = if self.narrow { 2 } else { 4 };
        self.n as usize * self.rows as usize * elem
    }
}

/// A product's device pointers: `a` the weight, `b` the activation, `c` the output (read too
/// where the shape accumulates).
#[derive(Debug, Clone, Copy)]
pub(crate) struct ProductPtrs {
    pub(crate) a: u64,
    pub(crate) b: u64,
    pub(crate) c: u64,
}

/// cuBLASLt's descriptors of one shape and the algorithm it runs with.
struct LtProduct {
    desc: lt::cublasLtMatmulDesc_t,
    a: lt::cublasLtMatrixLayout_t,
    b: lt::cublasLtMatrixLayout_t,
    c: lt::cublasLtMatrixLayout_t,
    algo: lt::cublasLtMatmulAlgo_t,
}

// SAFETY: the descriptors are host objects cuBLASLt only reads once made; `Tuning` uses them
// under the backend's GEMM lock.
unsafe impl Send for LtProduct {}

impl Drop for LtProduct {
    fn drop(&mut self) {
        // SAFETY: made by `describe`, destroyed once here.
        unsafe {
            lt::cublasLtMatrixLayoutDestroy(self.a);
            lt::cublasLtMatrixLayoutDestroy(self.b);
            lt::cublasLtMatrixLayoutDestroy(self.c);
            lt::cublasLtMatmulDescDestroy(self.desc);
        }
    }
}

/// One shape's choice as another rank adopts it: cuBLASLt's algorithm, or `None` for
/// `cublasGemmEx`'s pick.
#[derive(Serialize, Deserialize)]
struct Choice {
    shape: ProductShape,
    algo: Option<[u64; 8]>,
}

/// The timed shapes and their choices, with cuBLASLt's handle and workspace.
pub(crate) struct Tuning {
    handle: lt::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
    /// Every shape timed or adopted: cuBLASLt's algorithm where it won, else `None`.
    chosen: HashMap<ProductShape, Option<LtProduct>>,
    /// Whether a shape not yet chosen is timed.
    pub(crate) on: bool,
}

// SAFETY: the handle is used under the backend's GEMM lock, on the backend's one stream.
unsafe impl Send for Tuning {}

impl Drop for Tuning {
    fn drop(&mut self) {
        self.chosen.clear();
        // SAFETY: made in `new`, destroyed once, after every descriptor made with it.
        unsafe { lt::cublasLtDestroy(self.handle) };
    }
}

fn lt_failed(call: &str, e: CublasError) -> CudaError {
    CudaError::Unsupported(format!(
        "cuBLASLt {call} failed ({e}); check that libcublasLt matches the CUDA driver"
    ))
}

fn check(call: &str, status: lt::cublasStatus_t) -> Result<()> {
    status.result().map_err(|e| lt_failed(call, e))
}

impl Tuning {
    pub(crate) fn new(backend: &CudaBackend) -> Result<Tuning> {
        // SAFETY: only tries to load the library.
        if !unsafe { lt::is_culib_present() } {
            return Err(super::gemm::no_cublas());
        }
        let handle = cudarc::cublaslt::result::create_handle()
            .map_err(|e| lt_failed("cublasLtCreate", e))?;
        Ok(Tuning {
            handle,
            workspace: backend.alloc::<u8>(WORKSPACE_BYTES)?,
            chosen: HashMap::new(),
            on: false,
        })
    }

    /// Whether `shape` was timed or adopted.
    pub(crate) fn knows(&self, shape: &ProductShape) -> bool {
        self.chosen.contains_key(shape)
    }

    /// Runs the product with its chosen cuBLASLt algorithm; false where `cublasGemmEx` is to
    /// run it (not chosen, or chosen so).
    pub(crate) fn run(
        &mut self,
        backend: &CudaBackend,
        shape: &ProductShape,
        ptrs: ProductPtrs,
    ) -> Result<bool> {
        let Tuning {
            handle,
            workspace,
            chosen,
            ..
        } = self;
        let Some(Some(p)) = chosen.get(shape) else {
            return Ok(false);
        };
        matmul(backend, *handle, workspace, shape, p, ptrs)?;
        Ok(true)
    }

    /// Times `shape` on `ptrs`'s weight and activation and keeps the fastest way
    /// ([`Tuning::fastest`]). A timing that fails (its scratch buffers do not fit, say) is not
    /// the product's failure: the shape runs as `cublasGemmEx` picks, and timing stops.
    pub(crate) fn tune(
        &mut self,
        backend: &CudaBackend,
        shape: ProductShape,
        ptrs: ProductPtrs,
        default: impl FnMut(u64) -> Result<()>,
    ) {
        let chosen = self
            .fastest(backend, shape, ptrs, default)
            .unwrap_or_else(|e| {
                tracing::warn!(
                    ?shape,
                    "timing products stopped, the rest run as cuBLAS picks: {e}"
                );
                self.on = false;
                None
            });
        self.chosen.insert(shape, chosen);
    }

    /// `default` (which runs `cublasGemmEx` into the output it is given) against each
    /// algorithm cuBLASLt offers for `shape`, every run into a scratch output with the weight
    /// out of L2: the fastest of cuBLASLt's, where it beats the default.
    fn fastest(
        &mut self,
        backend: &CudaBackend,
        shape: ProductShape,
        ptrs: ProductPtrs,
        mut default: impl FnMut(u64) -> Result<()>,
    ) -> Result<Option<LtProduct>> {
        let mut scratch = backend.alloc::<u8>(shape.out_bytes())?;
        let (out, _sync) = scratch.device_ptr_mut(backend.stream());
        let timed = ProductPtrs { c: out, ..ptrs };
        // A weight of twice the L2 or more evicts its own last run's lines as it streams.
        let evict = shape.weight_bytes() < 2 * backend.gpu.l2_bytes as usize;
        let default_us = time_us(backend, evict, || default(out))?;
        let mut p = describe(&shape)?;
        let mut best: Option<(f64, lt::cublasLtMatmulAlgo_t)> = None;
        for algo in self.offered(&p)? {
            p.algo = algo;
            let (handle, workspace) = (self.handle, &mut self.workspace);
            let us = time_us(backend, evict, || {
                matmul(backend, handle, workspace, &shape, &p, timed)
            })?;
            if best.is_none_or(|(fastest, _)| us < fastest) {
                best = Some((us, algo));
            }
        }
        let chosen = match best {
            Some((us, algo)) if us < default_us * (1.0 - MARGIN) => {
                p.algo = algo;
                Some(p)
            }
            _ => None,
        };
        tracing::debug!(
            ?shape,
            default_us,
            fastest_offered_us = best.map(|(us, _)| us),
            cublaslt = chosen.is_some(),
            "timed a product"
        );
        Ok(chosen)
    }

    /// The algorithms cuBLASLt's heuristic offers for `p`'s shape, best first.
    fn offered(&self, p: &LtProduct) -> Result<Vec<lt::cublasLtMatmulAlgo_t>> {
        let pref = cudarc::cublaslt::result::create_matmul_pref()
            .map_err(|e| lt_failed("cublasLtMatmulPreferenceCreate", e))?;
        let bytes = WORKSPACE_BYTES;
        // SAFETY: the attribute is a size_t, as passed.
        let set = unsafe {
            cudarc::cublaslt::result::set_matmul_pref_attribute(
                pref,
                lt::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &bytes as *const usize as *const c_void,
                std::mem::size_of::<usize>(),
            )
        };
        // SAFETY: zeroed heuristic results are plain data the call overwrites.
        let mut found: Vec<lt::cublasLtMatmulHeuristicResult_t> =
            vec![unsafe { std::mem::zeroed() }; CANDIDATES];
        let mut count = 0;
        let status = set
            .map_err(|e| lt_failed("cublasLtMatmulPreferenceSetAttribute", e))
            .and_then(|()| {
                // SAFETY: the descriptors are `describe`'s, `found` holds CANDIDATES results.
                check("cublasLtMatmulAlgoGetHeuristic", unsafe {
                    lt::cublasLtMatmulAlgoGetHeuristic(
                        self.handle,
                        p.desc,
                        p.a,
                        p.b,
                        p.c,
                        p.c,
                        pref,
                        CANDIDATES as i32,
                        found.as_mut_ptr(),
                        &mut count,
                    )
                })
            });
        // SAFETY: made above, destroyed once.
        unsafe { lt::cublasLtMatmulPreferenceDestroy(pref) };
        status?;
        Ok(found[..count.max(0) as usize]
            .iter()
            .filter(|r| r.state == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS)
            .map(|r| r.algo)
            .collect())
    }

    /// Every choice made so far, as data for [`Tuning::adopt`].
    pub(crate) fn choices(&self) -> Result<Vec<u8>> {
        let choices: Vec<Choice> = self
            .chosen
            .iter()
            .map(|(shape, p)| Choice {
                shape: *shape,
                algo: p.as_ref().map(|p| p.algo.data),
            })
            .collect();
        serde_json::to_vec(&choices)
            .map_err(|e| CudaError::Unsupported(format!("product choices do not serialize: {e}")))
    }

    /// Takes another backend's [`Tuning::choices`], each algorithm checked by cuBLASLt here.
    pub(crate) fn adopt(&mut self, choices: &[u8]) -> Result<()> {
        let choices: Vec<Choice> = serde_json::from_slice(choices).map_err(|e| {
            CudaError::Unsupported(format!("another rank's product choices are garbled: {e}"))
        })?;
        for Choice { shape, algo } in choices {
            let chosen = match algo {
                None => None,
                Some(data) => {
                    let mut p = describe(&shape)?;
                    p.algo = lt::cublasLtMatmulAlgo_t { data };
                    // SAFETY: zeroed plain data the call overwrites.
                    let mut result: lt::cublasLtMatmulHeuristicResult_t =
                        unsafe { std::mem::zeroed() };
                    // SAFETY: `describe`'s descriptors and an algorithm of the same shape.
                    let status = unsafe {
                        lt::cublasLtMatmulAlgoCheck(
                            self.handle,
                            p.desc,
                            p.a,
                            p.b,
                            p.c,
                            p.c,
                            &p.algo,
                            &mut result,
                        )
                    };
                    if status != lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS
                        || result.workspaceSize > WORKSPACE_BYTES
                    {
                        return Err(CudaError::Unsupported(format!(
                            "this GPU cannot run the GEMM algorithm rank 0 chose for {shape:?} ({status:?}): every rank must run the same GPU model and CUDA libraries"
                        )));
                    }
                    Some(p)
                }
            };
            self.chosen.insert(shape, chosen);
        }
        Ok(())
    }
}

/// `shape`'s product on `ptrs` with `p`'s algorithm, on the backend's stream.
fn matmul(
    backend: &CudaBackend,
    handle: lt::cublasLtHandle_t,
    workspace: &mut CudaSlice<u8>,
    shape: &ProductShape,
    p: &LtProduct,
    ptrs: ProductPtrs,
) -> Result<()> {
    let (alpha, beta) = (1.0f32, if shape.accumulate { 1.0f32 } else { 0.0 });
    let stream = backend.stream();
    let (ws, _sync) = workspace.device_ptr_mut(stream);
    // SAFETY: the layouts describe the buffers the caller checked (A: the weight, B: the
    // activation, C = D: the output, `rows` columns each); the workspace holds
    // WORKSPACE_BYTES, the most the heuristic was allowed; host scalars of the 32F scale type;
    // the backend's stream.
    let status = unsafe {
        lt::cublasLtMatmul(
            handle,
            p.desc,
            &alpha as *const f32 as *const c_void,
            ptrs.a as *const c_void,
            p.a,
            ptrs.b as *const c_void,
            p.b,
            &beta as *const f32 as *const c_void,
            ptrs.c as *const c_void,
            p.c,
            ptrs.c as *mut c_void,
            p.c,
            &p.algo,
            ws as *mut c_void,
            WORKSPACE_BYTES,
            stream.cu_stream() as lt::cudaStream_t,
        )
    };
    check("cublasLtMatmul", status)
}

/// cuBLASLt's descriptors of `shape`, its algorithm still to be set.
fn describe(shape: &ProductShape) -> Result<LtProduct> {
    use cudarc::cublaslt::result as r;
    let fail = |call| move |e| lt_failed(call, e);
    let desc = r::create_matmul_desc(
        lt::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        lt::cudaDataType::CUDA_R_32F,
    )
    .map_err(fail("cublasLtMatmulDescCreate"))?;
    let transpose = cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_T as i32;
    // SAFETY: TRANSA is an int32 attribute.
    unsafe {
        r::set_matmul_desc_attribute(
            desc,
            lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
            &transpose as *const i32 as *const c_void,
            std::mem::size_of::<i32>(),
        )
    }
    .map_err(fail("cublasLtMatmulDescSetAttribute"))?;
    let (n, rows, k) = (shape.n as u64, shape.rows as u64, shape.k as u64);
    let layout = |t, r_, c_, ld| {
        r::create_matrix_layout(t, r_, c_, ld).map_err(fail("cublasLtMatrixLayoutCreate"))
    };
    Ok(LtProduct {
        desc,
        a: layout(shape.elem_type(), k, n, k as i64)?,
        b: layout(shape.elem_type(), k, rows, k as i64)?,
        c: layout(shape.out_type(), n, rows, n as i64)?,
        algo: lt::cublasLtMatmulAlgo_t { data: [0; 8] },
    })
}

/// The median of [`TIMED_RUNS`] runs of `f` in µs, each after L2 is evicted where `evict`,
/// after one run that loads its kernel.
fn time_us(backend: &CudaBackend, evict: bool, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    let stream = backend.stream();
    let mut events = Vec::with_capacity(TIMED_RUNS);
    for _ in 0..TIMED_RUNS {
        if evict {
            backend.evict_l2(false)?;
        }
        let start = stream
            .record_event(Some(CU_EVENT_DEFAULT))
            .ctx("cuEventRecord")?;
        f()?;
        let end = stream
            .record_event(Some(CU_EVENT_DEFAULT))
            .ctx("cuEventRecord")?;
        events.push((start, end));
    }
    let times = events
        .iter()
        .map(|(s, e)| Ok(1e3 * s.elapsed_ms(e).ctx("cuEventElapsedTime")? as f64))
        .collect::<Result<Vec<f64>>>()?;
    Ok(canopy_core::stats::median(&times))
}

#[cfg(test)]
mod tests {
    use super::{Choice, ProductShape, TUNED_ROWS};
    use canopy_core::DType;

    fn shape(dtype: DType, rows: usize) -> ProductShape {
        ProductShape {
            dtype,
            narrow: false,
            n: 4096,
            rows: rows as i32,
            k: 14336,
            accumulate: true,
        }
    }

    #[test]
    fn products_of_16_bit_weights_up_to_the_tuned_rows_are_timed() {
        for dtype in [DType::Bf16, DType::F16] {
            assert!(shape(dtype, 3).tuned());
            assert!(shape(dtype, TUNED_ROWS).tuned());
            assert!(!shape(dtype, TUNED_ROWS + 64).tuned());
        }
        assert!(!shape(DType::F32, 64).tuned(), "f32 runs in pedantic fp32");
    }

    #[test]
    fn choices_cross_between_ranks_as_they_were() {
        let sent = vec![
            Choice {
                shape: shape(DType::Bf16, 40),
                algo: Some([1, 2, 3, 4, 5, 6, 7, u64::MAX]),
            },
            Choice {
                shape: ProductShape {
                    narrow: true,
                    ..shape(DType::F16, 64)
                },
                algo: None,
            },
        ];
        let data = serde_json::to_vec(&sent).unwrap();
        let got: Vec<Choice> = serde_json::from_slice(&data).unwrap();
        assert_eq!(got.len(), sent.len());
        for (g, s) in got.iter().zip(&sent) {
            assert_eq!((g.shape, g.algo), (s.shape, s.algo));
        }
    }
}
