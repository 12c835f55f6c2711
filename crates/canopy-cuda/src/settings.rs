//! The attention kernels' launch settings a benchmark chooses, applied to a backend at once so
//! that every rank of a run gets the same.

use crate::backend::{CudaBackend, KernelChoice};
use crate::error::Result;
use canopy_kernels::MmaPipeline;

/// The attention kernels' launch settings a benchmark may choose
/// ([`CudaBackend::with_settings`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelSettings {
    /// The stage-1 kernel that runs plans.
    pub kernel: KernelChoice,
    /// Waves of resident CTAs a plan is split into (at least 1).
    pub waves: u32,
    /// Resident CTAs per SM the plans are cut for (`None`: the backend's own limit).
    pub ctas_per_sm: Option<u32>,
    /// How the tensor-core kernels stream KV.
    pub pipeline: MmaPipeline,
}

/// The backend's own settings.
impl Default for KernelSettings {
    fn default() -> Self {
        KernelSettings {
            kernel: KernelChoice::default(),
            waves: 1,
            ctas_per_sm: None,
            pipeline: MmaPipeline::default(),
        }
    }
}

impl CudaBackend {
    /// Every attention kernel setting of `settings` at once, so that each rank of a run gets
    /// the same.
    pub fn with_settings(self, settings: KernelSettings) -> Result<CudaBackend> {
        let backend = self
            .with_kernel(settings.kernel)
            .with_waves(settings.waves)
            .with_mma_pipeline(settings.pipeline)?;
        // Unset, the backend keeps its own limit.
        Ok(match settings.ctas_per_sm {
            Some(n) => backend.with_ctas_per_sm(Some(n)),
            None => backend,
        })
    }
}
