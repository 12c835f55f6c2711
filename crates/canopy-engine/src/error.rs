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
}

pub type Result<T, E = EngineError> = std::result::Result<T, E>;
