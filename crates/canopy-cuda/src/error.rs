use thiserror::Error;

/// Everything the CUDA backend can fail at, each saying what the user can do.
#[derive(Debug, Error)]
pub enum CudaError {
    #[error("no CUDA driver found (libcuda.so could not be loaded); install the NVIDIA driver on a machine with an NVIDIA GPU")]
    NoDriver,
    #[error("NVRTC (libnvrtc.so) could not be loaded; add the CUDA toolkit's lib folder (e.g. /usr/local/cuda/lib64) to LD_LIBRARY_PATH")]
    NoNvrtc,
    #[error("no CUDA GPU is visible (the driver reports {0} devices); check CUDA_VISIBLE_DEVICES")]
    NoDevice(i32),
    #[error(
        "GPU {ordinal} was requested but only {count} are visible; lower --ranks or use more GPUs"
    )]
    DeviceOutOfRange { ordinal: usize, count: usize },
    #[error("CUDA driver call failed in {context}: {source}")]
    Driver {
        context: String,
        source: cudarc::driver::DriverError,
    },
    #[error("NVRTC failed to compile kernel {kernel} ({options}):\n{log}")]
    Compile {
        kernel: String,
        options: String,
        log: String,
    },
    #[error("{0}")]
    Unsupported(String),
    #[error("rank {rank}: NCCL {call} failed: {detail}; check NCCL_DEBUG=WARN output, the GPUs' links, and that every rank was launched")]
    Nccl {
        rank: usize,
        call: &'static str,
        detail: String,
    },
    #[error("rank {rank}: watchdog: no progress for {secs:.1} s while waiting on {call}; a peer rank probably died or stalled, so this process ends (raise --timeout if the work is just slow)")]
    Watchdog {
        rank: usize,
        call: &'static str,
        secs: f64,
    },
    /// An engine call (through the `Backend` trait) failed inside a CUDA-only routine.
    #[error(transparent)]
    Engine(Box<canopy_engine::EngineError>),
}

impl From<canopy_engine::EngineError> for CudaError {
    fn from(e: canopy_engine::EngineError) -> Self {
        CudaError::Engine(Box::new(e))
    }
}

pub type Result<T, E = CudaError> = std::result::Result<T, E>;

/// Adds context to a driver result.
pub(crate) trait DriverContext<T> {
    fn ctx(self, context: impl Into<String>) -> Result<T>;
}

impl<T> DriverContext<T> for std::result::Result<T, cudarc::driver::DriverError> {
    fn ctx(self, context: impl Into<String>) -> Result<T> {
        self.map_err(|source| CudaError::Driver {
            context: context.into(),
            source,
        })
    }
}

impl From<CudaError> for canopy_engine::EngineError {
    /// An engine error that passed through this crate comes back as it was.
    fn from(e: CudaError) -> Self {
        match e {
            CudaError::Engine(e) => *e,
            e => canopy_engine::EngineError::Backend {
                backend: "cuda",
                message: e.to_string(),
            },
        }
    }
}
