//! The CUDA backend's activations and weights: device matrices, and the rounded copy a GEMM
//! operand holds in place of its values.

use crate::error::{CudaError, Result};
use canopy_core::DType;
use cudarc::driver::CudaSlice;

/// Activations: a row-major `rows × cols` fp32 matrix in device memory.
///
/// A GEMM operand ([`LayerOps::gemm_operand`]) of more rows than a GEMV takes, for a 16-bit
/// weight, holds its values rounded to the weight's dtype instead, written by the op that
/// produced them (`rms_norm`, SwiGLU, `states_output`), so the GEMM needs no rounding kernel of
/// its own; that op leaves `data` unwritten, since only the product reads the tensor (a
/// prefill's 8K rows write about 0.9 GB less a layer). Every other op writes `data` and drops
/// the rounded copy: a tensor holds its values in `data` exactly when it holds no rounded copy.
///
/// [`LayerOps::gemm_operand`]: canopy_engine::LayerOps::gemm_operand
pub struct CudaTensor {
    pub(crate) data: CudaSlice<f32>,
    pub(super) rows: usize,
    pub(super) cols: usize,
    /// The dtype of the weight this tensor feeds, when it keeps a rounded copy for it.
    pub(super) operand: Option<DType>,
    /// The tensor's values rounded to `operand`, held in place of `data` (left unwritten), or
    /// None when `data` holds the values.
    pub(super) rounded: Option<CudaSlice<u16>>,
}

impl CudaTensor {
    pub(super) fn new(data: CudaSlice<f32>, rows: usize, cols: usize) -> Self {
        CudaTensor {
            data,
            rows,
            cols,
            operand: None,
            rounded: None,
        }
    }

    /// The tensor's values rounded to `dtype`, if the op that produced them wrote them so.
    pub(crate) fn rounded_to(&self, dtype: DType) -> Option<&CudaSlice<u16>> {
        self.rounded
            .as_ref()
            .filter(|_| self.operand == Some(dtype))
    }

    /// Marks the rounded copy stale: the caller writes the values into `data`.
    pub(crate) fn drop_rounded(&mut self) {
        self.rounded = None;
    }

    /// `data`, the tensor's values for `op` to read: refused where the op that last wrote the
    /// tensor wrote only its rounded copy, which a product with its weight reads instead.
    pub(crate) fn values(&self, op: &str) -> Result<&CudaSlice<f32>> {
        match &self.rounded {
            None => Ok(&self.data),
            Some(_) => Err(CudaError::Unsupported(format!(
                "{op}: the tensor holds only its values rounded for a product (a GEMM operand); \
                 read it through a product with a weight of its dtype"
            ))),
        }
    }
}

/// A weight: a row-major `rows × cols` matrix in device memory, in the dtype it was uploaded in.
pub struct CudaWeight {
    pub(crate) data: CudaSlice<u8>,
    pub(super) dtype: DType,
    pub(super) rows: usize,
    pub(super) cols: usize,
}

impl CudaWeight {
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// `(rows, cols)`.
    pub fn dims(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }
}
