//! Built-in architectures, for timing a real model's shapes without its weights
//! (`canopy bench decode --arch NAME --random-weights`).
//!
//! Each preset is the `config.json` of the published checkpoint, embedded as JSON and read
//! by the same parser and validation as a model directory's, so a preset can never describe a
//! model that canopy would refuse to load from disk. Token ids are the base checkpoints'.

use serde_json::{json, Value};

use crate::config::LlamaConfig;
use crate::error::{ModelError, Result};

/// The names [`preset`] knows, in the order a listing should show them.
pub const PRESETS: &[&str] = &[
    "llama-3.1-8b",
    "llama-3.2-3b",
    "llama-3.2-1b",
    "smollm2-135m",
];

/// The configuration of the architecture `name` (one of [`PRESETS`]).
pub fn preset(name: &str) -> Result<LlamaConfig> {
    let json = preset_json(name).ok_or_else(|| ModelError::UnknownPreset {
        name: name.to_string(),
    })?;
    let config = LlamaConfig::from_hf_json(&json)?;
    config.validate()?;
    Ok(config)
}

/// The published `config.json` of each preset, trimmed to the fields canopy reads.
fn preset_json(name: &str) -> Option<Value> {
    let json = match name {
        "llama-3.1-8b" => llama3(
            json!({
                "hidden_size": 4096,
                "intermediate_size": 14336,
                "num_hidden_layers": 32,
                "num_attention_heads": 32,
                "head_dim": 128,
                "tie_word_embeddings": false,
            }),
            8.0,
        ),
        "llama-3.2-3b" => llama3(
            json!({
                "hidden_size": 3072,
                "intermediate_size": 8192,
                "num_hidden_layers": 28,
                "num_attention_heads": 24,
                "head_dim": 128,
                "tie_word_embeddings": true,
            }),
            32.0,
        ),
        "llama-3.2-1b" => llama3(
            json!({
                "hidden_size": 2048,
                "intermediate_size": 8192,
                "num_hidden_layers": 16,
                "num_attention_heads": 32,
                "head_dim": 64,
                "tie_word_embeddings": true,
            }),
            32.0,
        ),
        "smollm2-135m" => json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": 49152,
            "hidden_size": 576,
            "intermediate_size": 1536,
            "num_hidden_layers": 30,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "head_dim": 64,
            "rms_norm_eps": 1e-5,
            "rope_theta": 100000.0,
            "max_position_embeddings": 8192,
            "tie_word_embeddings": true,
            "bos_token_id": 0,
            "eos_token_id": 0,
        }),
        _ => return None,
    };
    Some(json)
}

/// A Llama 3.x checkpoint's `config.json`: the fields every published size shares (vocabulary,
/// 8 KV heads, RoPE base and llama3 scaling, positions, token ids), with `shape`'s fields and
/// the RoPE scaling `factor` of its size.
fn llama3(shape: Value, factor: f64) -> Value {
    let mut config = json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192
        },
        "max_position_embeddings": 131072,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    });
    if let (Some(config), Value::Object(shape)) = (config.as_object_mut(), shape) {
        config.extend(shape);
    }
    config
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RopeScaling;

    fn llama3_scaling(factor: f64) -> Option<RopeScaling> {
        Some(RopeScaling::Llama3 {
            factor,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        })
    }

    /// The shapes the presets must have, written out field by field.
    fn expected(name: &str) -> LlamaConfig {
        let llama = LlamaConfig {
            vocab_size: 128256,
            hidden_size: 4096,
            intermediate_size: 14336,
            num_hidden_layers: 32,
            num_attention_heads: 32,
            num_key_value_heads: 8,
            head_dim: 128,
            rms_norm_eps: 1e-5,
            rope_theta: 500000.0,
            rope_scaling: llama3_scaling(8.0),
            max_position_embeddings: 131072,
            tie_word_embeddings: false,
            bos_token_id: Some(128000),
            eos_token_ids: vec![128001],
        };
        match name {
            "llama-3.1-8b" => llama,
            "llama-3.2-3b" => LlamaConfig {
                hidden_size: 3072,
                intermediate_size: 8192,
                num_hidden_layers: 28,
                num_attention_heads: 24,
                rope_scaling: llama3_scaling(32.0),
                tie_word_embeddings: true,
                ..llama
            },
            "llama-3.2-1b" => LlamaConfig {
                hidden_size: 2048,
                intermediate_size: 8192,
                num_hidden_layers: 16,
                head_dim: 64,
                rope_scaling: llama3_scaling(32.0),
                tie_word_embeddings: true,
                ..llama
            },
            "smollm2-135m" => LlamaConfig {
                vocab_size: 49152,
                hidden_size: 576,
                intermediate_size: 1536,
                num_hidden_layers: 30,
                num_attention_heads: 9,
                num_key_value_heads: 3,
                head_dim: 64,
                rms_norm_eps: 1e-5,
                rope_theta: 100000.0,
                rope_scaling: None,
                max_position_embeddings: 8192,
                tie_word_embeddings: true,
                bos_token_id: Some(0),
                eos_token_ids: vec![0],
            },
            other => panic!("no expected shape for {other}"),
        }
    }

    #[test]
    fn every_preset_parses_with_its_shape() {
        for &name in PRESETS {
            let c = preset(name).unwrap();
            assert_eq!(c, expected(name), "{name}");
            let inv_freq = c.rope_inv_freq();
            assert_eq!(inv_freq.len(), c.head_dim / 2, "{name}");
            assert_eq!(inv_freq[0], 1.0, "{name}");
            assert!(
                inv_freq.windows(2).all(|w| w[1] < w[0] && w[1] > 0.0),
                "{name}: frequencies fall and stay positive"
            );
        }
    }

    /// Llama 3's scaling divides the lowest frequency (a wavelength far past the original
    /// 8192 tokens) by the factor and keeps the highest.
    #[test]
    fn llama_presets_scale_their_low_frequencies() {
        for (name, factor) in [
            ("llama-3.1-8b", 8.0),
            ("llama-3.2-3b", 32.0),
            ("llama-3.2-1b", 32.0),
        ] {
            let c = preset(name).unwrap();
            let scaled = c.rope_inv_freq();
            let unscaled = LlamaConfig {
                rope_scaling: None,
                ..c
            }
            .rope_inv_freq();
            let last = scaled.len() - 1;
            assert!(
                (scaled[last] * factor / unscaled[last] - 1.0).abs() < 1e-12,
                "{name}"
            );
            assert_eq!(scaled[0], unscaled[0], "{name}");
        }
    }

    #[test]
    fn an_unknown_name_lists_the_known_ones() {
        let err = preset("llama-9").unwrap_err().to_string();
        assert!(err.contains("`llama-9`"), "{err}");
        for name in PRESETS {
            assert!(err.contains(name), "{err}");
        }
    }
}
