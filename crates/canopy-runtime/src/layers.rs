//! A Llama decoder's layers around attention, on any backend that implements
//! [`LayerOps`]: everything a token's hidden state goes through except the attention itself,
//! which depends on where the KV lives (the engine's business, see [`crate::rank`]).
//!
//! The weights are uploaded once per device ([`ModelLayers::upload`]) and shared by every
//! rank on it; each call takes the calling rank's backend, whose stream orders its work.

use crate::{Result, RuntimeError};
use canopy_core::AttnShape;
use canopy_engine::LayerOps;
use canopy_model::{HostTensor, LlamaConfig, Weights};

/// A model's weights on a backend, checked once against its config, and its RoPE
/// frequencies.
pub struct ModelLayers<B: LayerOps> {
    pub config: LlamaConfig,
    embed: B::Weight,
    /// `None` when the output projection is tied to the embedding.
    lm_head: Option<B::Weight>,
    norm: B::Weight,
    layers: Vec<LayerWeights<B>>,
    inv_freq: Vec<f32>,
}

struct LayerWeights<B: LayerOps> {
    input_norm: B::Weight,
    q: B::Weight,
    k: B::Weight,
    v: B::Weight,
    o: B::Weight,
    post_norm: B::Weight,
    gate: B::Weight,
    up: B::Weight,
    down: B::Weight,
}

/// The query, key and value rows of one layer for a batch of tokens, rotated.
pub struct Qkv<B: LayerOps> {
    /// `rows × q_heads · head_dim`.
    pub q: B::Tensor,
    /// `rows × kv_heads · head_dim`.
    pub k: B::Tensor,
    pub v: B::Tensor,
}

/// Uploads `t` as a `rows × cols` matrix (a vector is `1 × len`), refusing another shape.
fn upload<B: LayerOps>(
    backend: &B,
    name: &str,
    t: HostTensor,
    rows: usize,
    cols: usize,
) -> Result<B::Weight> {
    if t.len() != rows * cols {
        return Err(RuntimeError::WeightShape {
            name: name.to_string(),
            shape: t.shape,
            expected: vec![rows, cols],
        });
    }
    Ok(backend.upload_weight(t.data, rows, cols)?)
}

impl<B: LayerOps> ModelLayers<B> {
    /// Uploads `weights` (shaped as `config` says) through `backend`. `on_layer` is called
    /// after each layer, for progress.
    pub fn upload(
        backend: &B,
        config: &LlamaConfig,
        weights: Weights,
        on_layer: &mut dyn FnMut(usize),
    ) -> Result<ModelLayers<B>> {
        let c = config;
        let (h, f, v) = (c.hidden_size, c.intermediate_size, c.vocab_size);
        let (qn, kvn) = (
            c.num_attention_heads * c.head_dim,
            c.num_key_value_heads * c.head_dim,
        );
        let Weights {
            embed_tokens,
            layers,
            norm,
            lm_head,
        } = weights;
        let mut uploaded = Vec::with_capacity(layers.len());
        for (i, l) in layers.into_iter().enumerate() {
            let name = |what: &str| format!("layer {i} {what}");
            uploaded.push(LayerWeights {
                input_norm: upload(backend, &name("input norm"), l.input_norm, 1, h)?,
                q: upload(backend, &name("q_proj"), l.q_proj, qn, h)?,
                k: upload(backend, &name("k_proj"), l.k_proj, kvn, h)?,
                v: upload(backend, &name("v_proj"), l.v_proj, kvn, h)?,
                o: upload(backend, &name("o_proj"), l.o_proj, h, qn)?,
                post_norm: upload(
                    backend,
                    &name("post-attention norm"),
                    l.post_attention_norm,
                    1,
                    h,
                )?,
                gate: upload(backend, &name("gate_proj"), l.gate_proj, f, h)?,
                up: upload(backend, &name("up_proj"), l.up_proj, f, h)?,
                down: upload(backend, &name("down_proj"), l.down_proj, h, f)?,
            });
            on_layer(i);
        }
        Ok(ModelLayers {
            config: config.clone(),
            embed: upload(backend, "embed_tokens", embed_tokens, v, h)?,
            lm_head: lm_head
                .map(|t| upload(backend, "lm_head", t, v, h))
                .transpose()?,
            norm: upload(backend, "norm", norm, 1, h)?,
            layers: uploaded,
            inv_freq: config
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
    pub fn embed(&self, b: &B, ids: &[u32]) -> Result<B::Tensor> {
        let mut x = b.tensor(ids.len(), self.config.hidden_size)?;
        b.embed(&self.embed, ids, &mut x)?;
        Ok(x)
    }

    /// Layer `l`'s rotated queries, keys and values of the hidden rows `x` at `positions`.
    pub fn qkv(&self, b: &B, l: usize, x: &B::Tensor, positions: &[u32]) -> Result<Qkv<B>> {
        let (c, layer) = (&self.config, &self.layers[l]);
        let (rows, h) = b.dims(x);
        let mut normed = b.tensor(rows, h)?;
        b.rms_norm(x, &layer.input_norm, c.rms_norm_eps as f32, &mut normed)?;
        let (qn, kvn) = (
            c.num_attention_heads * c.head_dim,
            c.num_key_value_heads * c.head_dim,
        );
        let mut q = b.tensor(rows, qn)?;
        let mut k = b.tensor(rows, kvn)?;
        let mut v = b.tensor(rows, kvn)?;
        b.matmul(&normed, &layer.q, &mut q)?;
        b.matmul(&normed, &layer.k, &mut k)?;
        b.matmul(&normed, &layer.v, &mut v)?;
        b.rope(&mut q, positions, &self.inv_freq)?;
        b.rope(&mut k, positions, &self.inv_freq)?;
        Ok(Qkv { q, k, v })
    }

    /// The rest of layer `l` in place on the hidden rows `x`, given its attention output
    /// (`rows × q_heads · head_dim`): the output projection and residual, then the MLP and
    /// its residual.
    pub fn finish(&self, b: &B, l: usize, x: &mut B::Tensor, attn: &B::Tensor) -> Result<()> {
        let (c, layer) = (&self.config, &self.layers[l]);
        let (rows, h) = b.dims(x);
        let f = c.intermediate_size;
        let mut y = b.tensor(rows, h)?;
        b.matmul(attn, &layer.o, &mut y)?;
        b.add(x, &y)?;
        let mut normed = b.tensor(rows, h)?;
        b.rms_norm(x, &layer.post_norm, c.rms_norm_eps as f32, &mut normed)?;
        let mut gate = b.tensor(rows, f)?;
        let mut up = b.tensor(rows, f)?;
        b.matmul(&normed, &layer.gate, &mut gate)?;
        b.matmul(&normed, &layer.up, &mut up)?;
        b.swiglu(&mut gate, &up)?;
        b.matmul(&gate, &layer.down, &mut y)?;
        b.add(x, &y)?;
        Ok(())
    }

    /// Next-token logits (`rows × vocab`, on the host) of the last layer's hidden rows
    /// `first..first + rows` of `x`.
    pub fn logits(&self, b: &B, x: &B::Tensor, first: usize, rows: usize) -> Result<Vec<f32>> {
        let c = &self.config;
        let mut picked = b.tensor(rows, c.hidden_size)?;
        b.copy_rows(x, first, &mut picked)?;
        let mut normed = b.tensor(rows, c.hidden_size)?;
        b.rms_norm(&picked, &self.norm, c.rms_norm_eps as f32, &mut normed)?;
        let mut out = b.tensor(rows, c.vocab_size)?;
        b.matmul(
            &normed,
            self.lm_head.as_ref().unwrap_or(&self.embed),
            &mut out,
        )?;
        Ok(b.download_tensor(&out)?)
    }
}
