use thiserror::Error;

#[derive(Debug, Error)]
pub enum EngineError {
    #[error(transparent)]
    Core(#[from] canopy_core::CoreError),
    #[error(transparent)]
    Comm(#[from] canopy_comm::CommError),
    #[error("{backend} backend: {message}")]
    Backend {
        backend: &'static str,
        message: String,
    },
    #[error("{0}")]
    Config(String),
    #[error("{what} needs {need_gib:.1} GiB of host memory but {available_gib:.1} GiB are available; use a shorter context, fewer ranks or a smaller batch")]
    OutOfMemory {
        what: String,
        need_gib: f64,
        available_gib: f64,
    },
}

pub type Result<T, E = EngineError> = std::result::Result<T, E>;
