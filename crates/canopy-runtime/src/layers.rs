//! A Llama decoder's layers on the host, around attention: everything a token's hidden state
//! goes through except the attention itself, which depends on where the KV lives (the
//! engine's business, see [`crate::rank`]).

use crate::ops::{add_in_place, matmul, rms_norm, rope_in_place, swiglu_in_place};
use crate::{Result, RuntimeError};
use canopy_core::{AttnShape, TypedVec};
use canopy_model::{HostTensor, LlamaConfig, Model};

/// A model's weights as f32 slices, checked once, and its RoPE frequencies.
pub struct Layers<'m> {
    pub config: &'m LlamaConfig,
    embed: &'m [f32],
    lm_head: &'m [f32],
    norm: &'m [f32],
    layers: Vec<LayerRefs<'m>>,
    inv_freq: Vec<f32>,
}

struct LayerRefs<'m> {
    input_norm: &'m [f32],
    q: &'m [f32],
    k: &'m [f32],
    v: &'m [f32],
    o: &'m [f32],
    post_norm: &'m [f32],
    gate: &'m [f32],
    up: &'m [f32],
    down: &'m [f32],
}

/// The query, key and value rows of one layer for a batch of tokens, rotated.
pub struct Qkv {
    /// `rows × q_heads × head_dim`.
    pub q: Vec<f32>,
    /// `rows × kv_heads × head_dim`.
    pub k: Vec<f32>,
    pub v: Vec<f32>,
}

fn f32s(t: &HostTensor) -> Result<&[f32]> {
    match &t.data {
        TypedVec::F32(v) => Ok(v),
        other => Err(RuntimeError::Dtype(other.dtype())),
    }
}

impl<'m> Layers<'m> {
    /// The layers of `model`, whose weights must have been loaded as f32.
    pub fn new(model: &'m Model) -> Result<Layers<'m>> {
        let w = &model.weights;
        let embed = f32s(&w.embed_tokens)?;
        let layers = w
            .layers
            .iter()
            .map(|l| {
                Ok(LayerRefs {
                    input_norm: f32s(&l.input_norm)?,
                    q: f32s(&l.q_proj)?,
                    k: f32s(&l.k_proj)?,
                    v: f32s(&l.v_proj)?,
                    o: f32s(&l.o_proj)?,
                    post_norm: f32s(&l.post_attention_norm)?,
                    gate: f32s(&l.gate_proj)?,
                    up: f32s(&l.up_proj)?,
                    down: f32s(&l.down_proj)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Layers {
            config: &model.config,
            embed,
            lm_head: f32s(w.output_projection())?,
            norm: f32s(&w.norm)?,
            layers,
            inv_freq: model
                .config
                .rope_inv_freq()
                .into_iter()
                .map(|f| f as f32)
                .collect(),
        })
    }

    /// The attention shape every layer shares.
    pub fn attn_shape(&self) -> AttnShape {
        AttnShape {
            q_heads: self.config.num_attention_heads,
            kv_heads: self.config.num_key_value_heads,
            head_dim: self.config.head_dim,
            scale: None,
        }
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// The embedding rows of `ids`: the hidden states entering layer 0.
    pub fn embed(&self, ids: &[u32]) -> Result<Vec<f32>> {
        let h = self.config.hidden_size;
        let mut x = Vec::with_capacity(ids.len() * h);
        for &id in ids {
            let row = self
                .embed
                .get(id as usize * h..(id as usize + 1) * h)
                .ok_or(RuntimeError::TokenOutOfRange {
                    id,
                    vocab: self.config.vocab_size,
                })?;
            x.extend_from_slice(row);
        }
        Ok(x)
    }

    /// Layer `l`'s rotated queries, keys and values of the hidden rows `x` at `positions`.
    pub fn qkv(&self, l: usize, x: &[f32], positions: &[u32]) -> Qkv {
        let c = self.config;
        let (rows, layer) = (positions.len(), &self.layers[l]);
        let mut normed = vec![0.0; x.len()];
        rms_norm(x, layer.input_norm, c.rms_norm_eps as f32, &mut normed);
        let (qn, kvn) = (
            c.num_attention_heads * c.head_dim,
            c.num_key_value_heads * c.head_dim,
        );
        let mut q = vec![0.0; rows * qn];
        let mut k = vec![0.0; rows * kvn];
        let mut v = vec![0.0; rows * kvn];
        matmul(&normed, rows, layer.q, qn, &mut q);
        matmul(&normed, rows, layer.k, kvn, &mut k);
        matmul(&normed, rows, layer.v, kvn, &mut v);
        rope_in_place(&mut q, positions, &self.inv_freq);
        rope_in_place(&mut k, positions, &self.inv_freq);
        Qkv { q, k, v }
    }

    /// The rest of layer `l` in place on the hidden rows `x`, given its attention output
    /// (`rows × q_heads × head_dim`): the output projection and residual, then the MLP and
    /// its residual.
    pub fn finish(&self, l: usize, x: &mut [f32], attn: &[f32]) {
        let c = self.config;
        let (h, f, layer) = (c.hidden_size, c.intermediate_size, &self.layers[l]);
        let rows = x.len() / h;
        let mut y = vec![0.0; rows * h];
        matmul(attn, rows, layer.o, h, &mut y);
        add_in_place(x, &y);
        let mut normed = vec![0.0; rows * h];
        rms_norm(x, layer.post_norm, c.rms_norm_eps as f32, &mut normed);
        let mut gate = vec![0.0; rows * f];
        let mut up = vec![0.0; rows * f];
        matmul(&normed, rows, layer.gate, f, &mut gate);
        matmul(&normed, rows, layer.up, f, &mut up);
        swiglu_in_place(&mut gate, &up);
        matmul(&gate, rows, layer.down, h, &mut y);
        add_in_place(x, &y);
    }

    /// Next-token logits (`rows × vocab`) of the last layer's hidden rows.
    pub fn logits(&self, x: &[f32]) -> Vec<f32> {
        let c = self.config;
        let rows = x.len() / c.hidden_size;
        let mut normed = vec![0.0; x.len()];
        rms_norm(x, self.norm, c.rms_norm_eps as f32, &mut normed);
        let mut out = vec![0.0; rows * c.vocab_size];
        matmul(&normed, rows, self.lm_head, c.vocab_size, &mut out);
        out
    }
}
