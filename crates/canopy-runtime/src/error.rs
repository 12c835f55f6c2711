use thiserror::Error;

#[derive(Debug, Error)]
pub enum RuntimeError {
    #[error(transparent)]
    Model(#[from] canopy_model::ModelError),
    #[error(transparent)]
    Engine(#[from] canopy_engine::EngineError),
    #[error(transparent)]
    Kv(#[from] canopy_kv::KvError),
    #[error(transparent)]
    Comm(#[from] canopy_comm::CommError),
    #[error(transparent)]
    Core(#[from] canopy_core::CoreError),
    #[error("{0}")]
    Protocol(String),
    #[error("the prompt is empty; give at least one token of text")]
    EmptyPrompt,
    #[error("a prompt of {prompt} tokens plus {max_tokens} new tokens exceeds the model's capacity of {capacity} tokens; shorten the prompt or lower --max-tokens")]
    TooLong {
        prompt: usize,
        max_tokens: usize,
        capacity: usize,
    },
}

pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;
