//! A Llama-family model's hyperparameters, read from Hugging Face `config.json` (plus the
//! optional `generation_config.json`) or from GGUF metadata, and the RoPE frequencies they
//! imply.

use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;

/// How RoPE frequencies are stretched for contexts longer than the model was pretrained on.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Llama 3.1's: low frequencies divided by `factor`, high ones kept, a smooth blend
    /// between (transformers' `_compute_llama3_parameters`).
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: usize,
    },
    /// Position interpolation: every frequency divided by `factor`.
    Linear { factor: f64 },
    /// One divisor per rotary pair, as llama.cpp stores Llama 3.1's scaling (the
    /// `rope_freqs.weight` tensor) instead of the parameters that produced it.
    PerPairDivisors(Vec<f64>),
}

/// Everything about a Llama-family model's shape that running it needs.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: Option<RopeScaling>,
    pub max_position_embeddings: usize,
    /// Whether the output projection reuses the token embedding matrix.
    pub tie_word_embeddings: bool,
    pub bos_token_id: Option<u32>,
    /// Generation stops at any of these.
    pub eos_token_ids: Vec<u32>,
}

/// Sampling defaults a model ships with (`generation_config.json`); `None` where it is silent.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GenerationDefaults {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub do_sample: Option<bool>,
}

/// HF writes token ids as one integer or a list of them.
#[derive(Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(u32),
    Many(Vec<u32>),
}

impl OneOrMany {
    fn into_vec(self) -> Vec<u32> {
        match self {
            OneOrMany::One(id) => vec![id],
            OneOrMany::Many(ids) => ids,
        }
    }
}

/// The subset of transformers' `LlamaConfig` canopy reads, with its defaults.
#[derive(Deserialize)]
struct HfConfig {
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    #[serde(default = "default_rms_norm_eps")]
    rms_norm_eps: f64,
    rope_theta: Option<f64>,
    rope_scaling: Option<Value>,
    /// transformers 5 folds `rope_theta` and `rope_scaling` into this one object.
    rope_parameters: Option<Value>,
    #[serde(default = "default_max_position_embeddings")]
    max_position_embeddings: usize,
    #[serde(default)]
    tie_word_embeddings: bool,
    /// The MLP's activation; Llama's is SiLU (`silu`, also named `swish`).
    hidden_act: Option<String>,
    /// Biases on the attention's and the MLP's projections, which Llama's checkpoints leave
    /// out and canopy's layers do not add.
    #[serde(default)]
    attention_bias: bool,
    #[serde(default)]
    mlp_bias: bool,
    bos_token_id: Option<u32>,
    eos_token_id: Option<OneOrMany>,
}

fn default_rms_norm_eps() -> f64 {
    1e-6
}

fn default_max_position_embeddings() -> usize {
    2048
}

#[derive(Deserialize)]
struct HfGenerationConfig {
    eos_token_id: Option<OneOrMany>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<usize>,
    do_sample: Option<bool>,
}

const DEFAULT_ROPE_THETA: f64 = 10_000.0;

fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
    serde_json::from_str(&text).map_err(|source| ModelError::Json {
        path: path.to_path_buf(),
        source,
    })
}

/// Refuses a `config.json` that does not describe a Llama model, before its fields are read,
/// so that e.g. a Qwen or GPT-2 directory gets an architecture error, not a missing field.
/// Mistral's is Llama's but for a sliding attention window: one without a window (Mistral 7B
/// v0.2 and later) is read as Llama.
fn check_hf_architecture(config: &Value) -> Result<()> {
    let architectures: Vec<&str> = config
        .get("architectures")
        .and_then(Value::as_array)
        .map(|list| list.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let model_type = config.get("model_type").and_then(Value::as_str);
    if architectures.contains(&"LlamaForCausalLM") || model_type == Some("llama") {
        return Ok(());
    }
    if architectures.contains(&"MistralForCausalLM") || model_type == Some("mistral") {
        return match config.get("sliding_window").and_then(Value::as_u64) {
            None => Ok(()),
            Some(window) => Err(ModelError::SlidingWindow { window }),
        };
    }
    let found = architectures
        .first()
        .copied()
        .or(model_type)
        .unwrap_or("(config.json names none)");
    Err(ModelError::UnsupportedArchitecture {
        found: found.to_string(),
    })
}

/// Refuses the layer settings of a Llama-family `config.json` that canopy's layers do not run,
/// so that such a model is not run as another.
fn check_hf_layers(hf: &HfConfig) -> Result<()> {
    let refuse = |setting: String| Err(ModelError::UnsupportedLayer { setting });
    match hf.hidden_act.as_deref() {
        None | Some("silu" | "swish") => {}
        Some(other) => return refuse(format!("hidden_act = \"{other}\"")),
    }
    if hf.attention_bias {
        return refuse("attention_bias = true".into());
    }
    if hf.mlp_bias {
        return refuse("mlp_bias = true".into());
    }
    Ok(())
}

fn parse_hf_rope_scaling(value: &Value) -> Result<Option<RopeScaling>> {
    if value.is_null() {
        return Ok(None);
    }
    let kind = value
        .get("rope_type")
        .or_else(|| value.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let number = |key: &str| {
        value.get(key).and_then(Value::as_f64).ok_or_else(|| {
            ModelError::InvalidConfig(format!("rope scaling `{kind}` needs a numeric `{key}`"))
        })
    };
    match kind {
        "default" => Ok(None),
        "linear" => Ok(Some(RopeScaling::Linear {
            factor: number("factor")?,
        })),
        "llama3" => Ok(Some(RopeScaling::Llama3 {
            factor: number("factor")?,
            low_freq_factor: number("low_freq_factor")?,
            high_freq_factor: number("high_freq_factor")?,
            original_max_position_embeddings: number("original_max_position_embeddings")? as usize,
        })),
        other => Err(ModelError::UnsupportedRopeScaling {
            found: other.to_string(),
        }),
    }
}

impl LlamaConfig {
    /// Reads `config.json` from a Hugging Face model directory, and its
    /// `generation_config.json` where there is one (its eos ids take precedence).
    pub fn from_hf_dir(dir: &Path) -> Result<(Self, GenerationDefaults)> {
        let config_path = dir.join("config.json");
        if !config_path.is_file() {
            return Err(ModelError::MissingFile {
                dir: dir.to_path_buf(),
                file: "config.json".into(),
            });
        }
        let mut config = Self::parse_hf_config(&read_json(&config_path)?, &config_path)?;
        let mut generation = GenerationDefaults::default();
        let generation_path = dir.join("generation_config.json");
        if generation_path.is_file() {
            let json: HfGenerationConfig = serde_json::from_value(read_json(&generation_path)?)
                .map_err(|source| ModelError::Json {
                    path: generation_path.clone(),
                    source,
                })?;
            if let Some(eos) = json.eos_token_id {
                config.eos_token_ids = eos.into_vec();
            }
            generation = GenerationDefaults {
                temperature: json.temperature,
                top_p: json.top_p,
                top_k: json.top_k,
                do_sample: json.do_sample,
            };
        }
        config.validate()?;
        Ok((config, generation))
    }

    /// Parses the contents of a `config.json` (not validated: see [`LlamaConfig::validate`]).
    pub fn from_hf_json(json: &Value) -> Result<Self> {
        Self::parse_hf_config(json, Path::new("config.json"))
    }

    fn parse_hf_config(json: &Value, path: &Path) -> Result<Self> {
        check_hf_architecture(json)?;
        let hf: HfConfig =
            serde_json::from_value(json.clone()).map_err(|source| ModelError::Json {
                path: path.to_path_buf(),
                source,
            })?;
        check_hf_layers(&hf)?;
        let (rope_theta, rope_scaling) = match &hf.rope_parameters {
            Some(params) => {
                let scaling = parse_hf_rope_scaling(params)?;
                // A config that carries both (as transformers 5 may) must not disagree.
                if let Some(legacy) = &hf.rope_scaling {
                    let legacy = parse_hf_rope_scaling(legacy)?;
                    if legacy.is_some() && legacy != scaling {
                        return Err(ModelError::InvalidConfig(format!(
                            "config.json's rope_scaling ({legacy:?}) and rope_parameters \
                             ({scaling:?}) disagree; keep the one the model was trained with"
                        )));
                    }
                }
                (params.get("rope_theta").and_then(Value::as_f64), scaling)
            }
            None => (
                hf.rope_theta,
                hf.rope_scaling
                    .as_ref()
                    .map(parse_hf_rope_scaling)
                    .transpose()?
                    .flatten(),
            ),
        };
        let head_dim = match hf.head_dim {
            Some(d) => d,
            None if hf.num_attention_heads > 0 => hf.hidden_size / hf.num_attention_heads,
            None => 0,
        };
        Ok(LlamaConfig {
            vocab_size: hf.vocab_size,
            hidden_size: hf.hidden_size,
            intermediate_size: hf.intermediate_size,
            num_hidden_layers: hf.num_hidden_layers,
            num_attention_heads: hf.num_attention_heads,
            num_key_value_heads: hf.num_key_value_heads.unwrap_or(hf.num_attention_heads),
            head_dim,
            rms_norm_eps: hf.rms_norm_eps,
            rope_theta: rope_theta.unwrap_or(DEFAULT_ROPE_THETA),
            rope_scaling,
            max_position_embeddings: hf.max_position_embeddings,
            tie_word_embeddings: hf.tie_word_embeddings,
            bos_token_id: hf.bos_token_id,
            eos_token_ids: hf.eos_token_id.map(OneOrMany::into_vec).unwrap_or_default(),
        })
    }

    /// Reads the `llama.*` and `tokenizer.ggml.*` metadata of a GGUF file, and whether it
    /// carries its own output matrix (`output.weight`) or ties it to the embedding.
    pub fn from_gguf(gguf: &GgufFile) -> Result<Self> {
        let architecture = gguf.require_str("general.architecture")?;
        if architecture != "llama" {
            return Err(ModelError::UnsupportedArchitecture {
                found: architecture.to_string(),
            });
        }
        let usize_key = |key: &str| gguf.require_u64(key).map(|v| v as usize);
        let hidden_size = usize_key("llama.embedding_length")?;
        let num_attention_heads = usize_key("llama.attention.head_count")?;
        let num_key_value_heads = match gguf.get_u64("llama.attention.head_count_kv")? {
            Some(n) => n as usize,
            None => num_attention_heads,
        };
        let head_dim = match (
            gguf.get_u64("llama.attention.key_length")?,
            gguf.get_u64("llama.rope.dimension_count")?,
        ) {
            (Some(d), _) | (None, Some(d)) => d as usize,
            (None, None) => hidden_size.checked_div(num_attention_heads).unwrap_or(0),
        };
        if let Some(rotary) = gguf.get_u64("llama.rope.dimension_count")? {
            if rotary as usize != head_dim {
                return Err(ModelError::InvalidConfig(format!(
                    "llama.rope.dimension_count is {rotary} but the head dimension is {head_dim}; canopy rotates whole heads"
                )));
            }
        }
        let vocab_size = match gguf.get_u64("llama.vocab_size")? {
            Some(n) => n as usize,
            None => gguf
                .get_strings("tokenizer.ggml.tokens")?
                .map(|tokens| tokens.len())
                .ok_or_else(|| ModelError::MissingMetadata {
                    path: gguf.path().to_path_buf(),
                    key: "llama.vocab_size (or tokenizer.ggml.tokens)".into(),
                })?,
        };
        let token_id = |key: &str| gguf.get_u64(key).map(|id| id.map(|id| id as u32));
        let mut eos_token_ids = Vec::new();
        for key in [
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.eot_token_id",
            "tokenizer.ggml.eom_token_id",
        ] {
            if let Some(id) = token_id(key)? {
                if !eos_token_ids.contains(&id) {
                    eos_token_ids.push(id);
                }
            }
        }
        Ok(LlamaConfig {
            vocab_size,
            hidden_size,
            intermediate_size: usize_key("llama.feed_forward_length")?,
            num_hidden_layers: usize_key("llama.block_count")?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps: gguf
                .get_f64("llama.attention.layer_norm_rms_epsilon")?
                .ok_or_else(|| ModelError::MissingMetadata {
                    path: gguf.path().to_path_buf(),
                    key: "llama.attention.layer_norm_rms_epsilon".into(),
                })?,
            rope_theta: gguf
                .get_f64("llama.rope.freq_base")?
                .unwrap_or(DEFAULT_ROPE_THETA),
            rope_scaling: gguf_rope_scaling(gguf)?,
            max_position_embeddings: usize_key("llama.context_length")?,
            tie_word_embeddings: gguf.tensor_info("output.weight").is_none(),
            bos_token_id: token_id("tokenizer.ggml.bos_token_id")?,
            eos_token_ids,
        })
    }

    /// Reads the configuration alone from a model directory or GGUF file.
    pub fn load(path: &Path) -> Result<Self> {
        if path.is_dir() {
            Ok(Self::from_hf_dir(path)?.0)
        } else {
            let config = Self::from_gguf(&GgufFile::open(path)?)?;
            config.validate()?;
            Ok(config)
        }
    }

    /// Checks the relations the forward pass relies on.
    pub fn validate(&self) -> Result<()> {
        let fail = |reason: String| Err(ModelError::InvalidConfig(reason));
        for (name, value) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("max_position_embeddings", self.max_position_embeddings),
        ] {
            if value == 0 {
                return fail(format!("{name} is 0"));
            }
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return fail(format!(
                "{} attention heads cannot be shared evenly by {} key-value heads",
                self.num_attention_heads, self.num_key_value_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return fail(format!(
                "head_dim {} is odd; RoPE rotates pairs",
                self.head_dim
            ));
        }
        if !is_positive(self.rms_norm_eps) {
            return fail(format!(
                "rms_norm_eps {} is not a positive number",
                self.rms_norm_eps
            ));
        }
        if !is_positive(self.rope_theta) {
            return fail(format!(
                "rope_theta {} is not a positive number",
                self.rope_theta
            ));
        }
        let pairs = self.head_dim / 2;
        match &self.rope_scaling {
            Some(RopeScaling::Linear { factor }) if !is_positive(*factor) => {
                return fail(format!(
                    "linear rope scaling factor {factor} is not positive"
                ));
            }
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            }) if !(is_positive(*factor)
                && is_positive(*low_freq_factor)
                && high_freq_factor > low_freq_factor
                && *original_max_position_embeddings > 0) =>
            {
                return fail(format!(
                    "llama3 rope scaling needs factor > 0, 0 < low_freq_factor < high_freq_factor and original_max_position_embeddings > 0; got {factor}, {low_freq_factor}, {high_freq_factor}, {original_max_position_embeddings}"
                ));
            }
            Some(RopeScaling::PerPairDivisors(divisors))
                if divisors.len() != pairs || !divisors.iter().all(|&d| is_positive(d)) =>
            {
                return fail(format!(
                    "rope_freqs holds {} divisors for {pairs} rotary pairs, or one that is not positive",
                    divisors.len()
                ));
            }
            _ => {}
        }
        for &id in self.bos_token_id.iter().chain(&self.eos_token_ids) {
            if id as usize >= self.vocab_size {
                return fail(format!(
                    "special token id {id} is outside the vocabulary of {}",
                    self.vocab_size
                ));
            }
        }
        Ok(())
    }

    /// The attention shape every layer shares (the default softmax scale, `1/sqrt(head_dim)`).
    pub fn attn_shape(&self) -> canopy_core::AttnShape {
        canopy_core::AttnShape {
            q_heads: self.num_attention_heads,
            kv_heads: self.num_key_value_heads,
            head_dim: self.head_dim,
            scale: None,
        }
    }

    /// Bytes of every weight of this shape in `dtype`: what [`Weights`](crate::Weights) of it
    /// hold, and what one decode step reads once.
    pub fn weight_bytes(&self, dtype: canopy_core::DType) -> u64 {
        let (h, f, v) = (self.hidden_size, self.intermediate_size, self.vocab_size);
        let q = self.num_attention_heads * self.head_dim;
        let kv = self.num_key_value_heads * self.head_dim;
        // Two norms, q, k, v, o, gate, up, down.
        let layer = 2 * h + h * q + 2 * h * kv + q * h + 3 * h * f;
        let head = if self.tie_word_embeddings { 0 } else { v * h };
        ((self.num_hidden_layers * layer + v * h + h + head) * dtype.size_bytes()) as u64
    }

    /// Query heads per key-value head.
    pub fn gqa_group_size(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads
    }

    /// The rotation frequency of each of the `head_dim / 2` pairs, after scaling: pair `i`
    /// of a query or key at position `p` turns by `p * inv_freq[i]` radians. Computed in f64,
    /// where transformers uses f32; the two agree to f32 rounding.
    pub fn rope_inv_freq(&self) -> Vec<f64> {
        let dim = self.head_dim as f64;
        let base: Vec<f64> = (0..self.head_dim / 2)
            .map(|i| 1.0 / self.rope_theta.powf((2 * i) as f64 / dim))
            .collect();
        match &self.rope_scaling {
            None => base,
            Some(RopeScaling::Linear { factor }) => base.iter().map(|f| f / factor).collect(),
            Some(RopeScaling::PerPairDivisors(divisors)) => {
                base.iter().zip(divisors).map(|(f, d)| f / d).collect()
            }
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            }) => {
                let (factor, low_freq_factor, high_freq_factor) =
                    (*factor, *low_freq_factor, *high_freq_factor);
                let old_context = *original_max_position_embeddings as f64;
                let low_freq_wavelen = old_context / low_freq_factor;
                let high_freq_wavelen = old_context / high_freq_factor;
                base.iter()
                    .map(|&freq| {
                        let wavelen = 2.0 * std::f64::consts::PI / freq;
                        if wavelen < high_freq_wavelen {
                            freq
                        } else if wavelen > low_freq_wavelen {
                            freq / factor
                        } else {
                            let smooth = (old_context / wavelen - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * freq / factor + smooth * freq
                        }
                    })
                    .collect()
            }
        }
    }
}

/// Positive and finite (false for NaN).
fn is_positive(x: f64) -> bool {
    x > 0.0 && x.is_finite()
}

/// GGUF's rope scaling: `llama.rope.scaling.type` (or the older `llama.rope.scale_linear`),
/// or llama.cpp's per-pair divisors in the `rope_freqs.weight` tensor.
fn gguf_rope_scaling(gguf: &GgufFile) -> Result<Option<RopeScaling>> {
    if gguf.tensor_info("rope_freqs.weight").is_some() {
        let divisors = gguf.read_tensor("rope_freqs.weight", canopy_core::DType::F32)?;
        return Ok(Some(RopeScaling::PerPairDivisors(
            divisors
                .data
                .to_f32_vec()
                .into_iter()
                .map(f64::from)
                .collect(),
        )));
    }
    let factor = gguf.get_f64("llama.rope.scaling.factor")?;
    match gguf.get_str("llama.rope.scaling.type")? {
        None | Some("none") => {}
        Some("linear") => {
            let factor = factor.ok_or_else(|| ModelError::MissingMetadata {
                path: gguf.path().to_path_buf(),
                key: "llama.rope.scaling.factor".into(),
            })?;
            return Ok(Some(RopeScaling::Linear { factor }));
        }
        Some(other) => {
            return Err(ModelError::UnsupportedRopeScaling {
                found: other.to_string(),
            })
        }
    }
    Ok(gguf
        .get_f64("llama.rope.scale_linear")?
        .filter(|&factor| factor != 1.0)
        .map(|factor| RopeScaling::Linear { factor }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn an_8b_shape_weighs_what_llama_3_1_8b_does() {
        let c = crate::preset("llama-3.1-8b").unwrap();
        let gb = c.weight_bytes(canopy_core::DType::Bf16) as f64 / 1e9;
        assert!((gb - 16.06).abs() < 0.01, "{gb}");
    }

    fn llama31_json() -> Value {
        json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": 128256,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192, "rope_type": "llama3"
            },
            "max_position_embeddings": 131072,
            "bos_token_id": 128000,
            "eos_token_id": [128001, 128008, 128009],
        })
    }

    #[test]
    fn reads_llama31_config() {
        let config = LlamaConfig::from_hf_json(&llama31_json()).unwrap();
        config.validate().unwrap();
        assert_eq!(config.head_dim, 128);
        assert_eq!(config.gqa_group_size(), 4);
        assert!(!config.tie_word_embeddings);
        assert_eq!(config.eos_token_ids, vec![128001, 128008, 128009]);
        assert!(
            matches!(config.rope_scaling, Some(RopeScaling::Llama3 { factor, .. }) if factor == 8.0)
        );
    }

    /// Reference values from transformers' formula evaluated in Python (float64) for
    /// Llama 3.1's parameters: high-frequency pairs are kept, low ones divided by 8, pairs
    /// 29..=34 (wavelengths 2048..8192 tokens) blended.
    #[test]
    fn llama3_frequencies_match_transformers() {
        let inv_freq = LlamaConfig::from_hf_json(&llama31_json())
            .unwrap()
            .rope_inv_freq();
        assert_eq!(inv_freq.len(), 64);
        let expected = [
            (0, 1.0),
            (1, 0.8146172338565447),
            (20, 0.016560440080994446),
            (29, 0.002166570763503359),
            (30, 0.0013718935677611381),
            (32, 0.0005248461609929547),
            (34, 0.00017850781276799638),
            (40, 3.428102195952591e-05),
            (47, 8.160728247435943e-06),
            (63, 3.068925988914511e-07),
        ];
        for (pair, want) in expected {
            let got = inv_freq[pair];
            assert!(
                (got - want).abs() <= 1e-12 * want,
                "pair {pair}: {got} vs {want}"
            );
        }
    }

    #[test]
    fn linear_scaling_divides_every_frequency() {
        let mut json = llama31_json();
        json["rope_scaling"] = json!({"type": "linear", "factor": 2.0});
        let scaled = LlamaConfig::from_hf_json(&json).unwrap();
        json["rope_scaling"] = Value::Null;
        let plain = LlamaConfig::from_hf_json(&json).unwrap();
        assert_eq!(plain.rope_scaling, None);
        for (s, p) in scaled.rope_inv_freq().iter().zip(plain.rope_inv_freq()) {
            assert_eq!(*s, p / 2.0);
        }
    }

    #[test]
    fn unknown_rope_scaling_is_refused() {
        let mut json = llama31_json();
        json["rope_scaling"] = json!({"rope_type": "yarn", "factor": 4.0});
        let err = LlamaConfig::from_hf_json(&json).unwrap_err();
        assert!(
            err.to_string()
                .contains("unsupported rope scaling type `yarn`"),
            "{err}"
        );
    }

    /// A rope scaling beside `rope_parameters` is read too: refused where canopy does not run
    /// it or where it disagrees, accepted where it says the same.
    #[test]
    fn rope_scaling_beside_rope_parameters_must_agree() {
        let mut json = llama31_json();
        let llama3 = json["rope_scaling"].clone();
        let mut params = llama3.clone();
        params["rope_theta"] = json["rope_theta"].clone();
        json["rope_parameters"] = params;
        let both = LlamaConfig::from_hf_json(&json).unwrap();
        assert!(matches!(
            both.rope_scaling,
            Some(RopeScaling::Llama3 { .. })
        ));
        for (legacy, refusal) in [
            (json!({"rope_type": "yarn", "factor": 4.0}), "`yarn`"),
            (json!({"rope_type": "nonsense"}), "`nonsense`"),
            (json!({"type": "linear", "factor": 2.0}), "disagree"),
        ] {
            json["rope_scaling"] = legacy;
            let err = LlamaConfig::from_hf_json(&json).unwrap_err().to_string();
            assert!(err.contains(refusal), "{err}");
        }
    }

    /// Layers other than Llama's are refused by name, not run as Llama's.
    #[test]
    fn other_layers_are_refused() {
        for (key, value, named) in [
            ("hidden_act", json!("gelu"), "hidden_act = \"gelu\""),
            (
                "hidden_act",
                json!("gelu_pytorch_tanh"),
                "gelu_pytorch_tanh",
            ),
            ("attention_bias", json!(true), "attention_bias = true"),
            ("mlp_bias", json!(true), "mlp_bias = true"),
        ] {
            let mut json = llama31_json();
            json[key] = value;
            let err = LlamaConfig::from_hf_json(&json).unwrap_err().to_string();
            assert!(err.contains(named), "{err}");
        }
        let mut json = llama31_json();
        for (key, value) in [
            ("hidden_act", json!("silu")),
            ("attention_bias", json!(false)),
            ("mlp_bias", json!(false)),
        ] {
            json[key] = value;
        }
        LlamaConfig::from_hf_json(&json).unwrap();
    }

    #[test]
    fn other_architectures_are_named() {
        let mut json = llama31_json();
        json["architectures"] = json!(["Qwen2ForCausalLM"]);
        json["model_type"] = json!("qwen2");
        let err = LlamaConfig::from_hf_json(&json).unwrap_err();
        assert_eq!(
            err.to_string(),
            "unsupported architecture Qwen2ForCausalLM; canopy runs Llama-family models (LlamaForCausalLM, MistralForCausalLM without a sliding window, or GGUF with general.architecture = llama)"
        );
    }

    /// Mistral's config is Llama's with `sliding_window`: read as Llama where it is null, refused
    /// where it bounds attention.
    #[test]
    fn mistral_without_a_window_reads_as_llama() {
        let mut json = llama31_json();
        json["architectures"] = json!(["MistralForCausalLM"]);
        json["model_type"] = json!("mistral");
        json["sliding_window"] = Value::Null;
        let mistral = LlamaConfig::from_hf_json(&json).unwrap();
        assert_eq!(mistral, LlamaConfig::from_hf_json(&llama31_json()).unwrap());
        json["sliding_window"] = json!(4096);
        assert_eq!(
            LlamaConfig::from_hf_json(&json).unwrap_err().to_string(),
            "this Mistral model attends through a sliding window of 4096 tokens, which canopy does not run; Mistral models without one (sliding_window null: Mistral 7B v0.2 and later) load as Llama"
        );
    }

    #[test]
    fn eos_may_be_one_id_and_head_dim_defaults() {
        let mut json = llama31_json();
        json["eos_token_id"] = json!(2);
        json["head_dim"] = Value::Null;
        let config = LlamaConfig::from_hf_json(&json).unwrap();
        assert_eq!(config.eos_token_ids, vec![2]);
        assert_eq!(config.head_dim, 4096 / 32);
    }

    #[test]
    fn validate_rejects_uneven_heads_and_odd_head_dim() {
        let mut config = LlamaConfig::from_hf_json(&llama31_json()).unwrap();
        config.num_key_value_heads = 5;
        assert!(config
            .validate()
            .unwrap_err()
            .to_string()
            .contains("shared evenly"));
        config.num_key_value_heads = 8;
        config.head_dim = 127;
        assert!(config.validate().unwrap_err().to_string().contains("odd"));
    }
}
