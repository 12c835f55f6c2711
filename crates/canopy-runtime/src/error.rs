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
    #[error("{samples} samples of a prompt of {prompt} tokens and up to {max_tokens} new tokens each need more KV pages or positions than a rank addresses (2^32); ask for fewer samples or tokens")]
    TooManyTokens {
        prompt: usize,
        samples: usize,
        max_tokens: usize,
    },
}

pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;
