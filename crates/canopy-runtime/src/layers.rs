//! A Llama decoder's layers around attention, on any backend that implements
//! [`LayerOps`]: everything a token's hidden state goes through except the attention itself,
//! which depends on where the KV lives (the engine's business, see [`crate::rank`]).
//!
//! The weights are uploaded once per device ([`ModelLayers::upload`], or drawn at random with
//! the model's shapes by [`ModelLayers::random`], to time a model without its weights) and
//! shared by every rank on it; each call takes the calling rank's backend, whose stream
//! orders its work.

use crate::{Result, RuntimeError};
use canopy_core::data::splitmix64;
use canopy_core::{AttnShape, DType, TypedVec};
use canopy_engine::{LayerOps, ModelNeeds};
use canopy_model::{HostTensor, LlamaConfig, Weights};
use rayon::prelude::*;

/// A model's weights on a backend, checked once against its config, and its RoPE
/// frequencies.
pub struct ModelLayers<B: LayerOps> {
    pub config: LlamaConfig,
    embed: B::Weight,
    /// `None` when the output projection is tied to the embedding.
    lm_head: Option<B::Weight>,
    norm: B::Weight,
    layers: Vec<LayerWeights<B>>,
    /// RoPE's frequencies, `1 × head_dim / 2` in f32.
    inv_freq: B::Weight,
}

/// One layer's weights. The projections that read the same input are one matrix, their rows
/// stacked, so a decode step streams them in one pass: q, k and v (`qkv`), and the MLP's gate
/// and up (`gate_up`).
struct LayerWeights<B: LayerOps> {
    input_norm: B::Weight,
    qkv: B::Weight,
    o: B::Weight,
    post_norm: B::Weight,
    gate_up: B::Weight,
    down: B::Weight,
}

pub use canopy_engine::KvStore;

/// The query, key and value rows of one layer for a batch of tokens, rotated.
pub struct Qkv<B: LayerOps> {
    /// `rows × q_heads · head_dim`.
    pub q: B::Tensor,
    /// `rows × kv_heads · head_dim`.
    pub k: B::Tensor,
    pub v: B::Tensor,
}

// A decode pass allocates the activations each layer writes again (`QkvScratch`,
// `MlpScratch`) once, before its first kernel. In a recorded pass, a buffer allocated or freed
// between two kernels is a node between them, and the later kernel then cannot launch as the
// earlier one's programmatic dependent.

/// The q|k|v projection's operand (its rows normalised) and product, and the rotated keys
/// and values: what [`ModelLayers::qkv_with`] writes besides the queries.
pub struct QkvScratch<B: LayerOps> {
    operand: B::Tensor,
    fused: B::Tensor,
    k: B::Tensor,
    v: B::Tensor,
}

/// The gate|up projection's operand and the down projection's (SwiGLU's output): what
/// [`ModelLayers::finish_states`] writes.
pub struct MlpScratch<B: LayerOps> {
    operand: B::Tensor,
    act: B::Tensor,
}

/// One matrix of a layer, in the order [`ModelLayers`] uploads them and
/// [`canopy_model::LayerWeights`] lists them (`Part as usize` indexes that list).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Part {
    InputNorm,
    Q,
    K,
    V,
    O,
    PostNorm,
    Gate,
    Up,
    Down,
}

const PARTS: [Part; 9] = [
    Part::InputNorm,
    Part::Q,
    Part::K,
    Part::V,
    Part::O,
    Part::PostNorm,
    Part::Gate,
    Part::Up,
    Part::Down,
];

/// One of a model's weights. Both sources of weights answer to it: a loaded model finds its
/// tensor by it, random weights seed their values with its [`WeightId::ordinal`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WeightId {
    Embed,
    Layer(usize, Part),
    FinalNorm,
    LmHead,
}

impl WeightId {
    /// The name errors use.
    fn name(self) -> String {
        let part = |p| match p {
            Part::InputNorm => "input norm",
            Part::Q => "q_proj",
            Part::K => "k_proj",
            Part::V => "v_proj",
            Part::O => "o_proj",
            Part::PostNorm => "post-attention norm",
            Part::Gate => "gate_proj",
            Part::Up => "up_proj",
            Part::Down => "down_proj",
        };
        match self {
            WeightId::Embed => "embed_tokens".into(),
            WeightId::Layer(l, p) => format!("layer {l} {}", part(p)),
            WeightId::FinalNorm => "norm".into(),
            WeightId::LmHead => "lm_head".into(),
        }
    }

    /// A number of its own, whatever the model's depth.
    fn ordinal(self) -> u64 {
        match self {
            WeightId::Embed => 0,
            WeightId::FinalNorm => 1,
            WeightId::LmHead => 2,
            WeightId::Layer(l, p) => 3 + (l * PARTS.len() + p as usize) as u64,
        }
    }

    fn is_norm(self) -> bool {
        matches!(
            self,
            WeightId::FinalNorm | WeightId::Layer(_, Part::InputNorm | Part::PostNorm)
        )
    }

    /// `(rows, cols)` as `c` implies (a vector is `1 × len`).
    fn shape(self, c: &LlamaConfig) -> (usize, usize) {
        let (h, f) = (c.hidden_size, c.intermediate_size);
        let (qn, kvn) = (
            c.num_attention_heads * c.head_dim,
            c.num_key_value_heads * c.head_dim,
        );
        match self {
            WeightId::Embed | WeightId::LmHead => (c.vocab_size, h),
            WeightId::FinalNorm => (1, h),
            WeightId::Layer(_, p) => match p {
                Part::InputNorm | Part::PostNorm => (1, h),
                Part::Q => (qn, h),
                Part::K | Part::V => (kvn, h),
                Part::O => (h, qn),
                Part::Gate | Part::Up => (f, h),
                Part::Down => (h, f),
            },
        }
    }
}

/// Hands out each weight's host data when [`ModelLayers::build`] asks for it (once each),
/// given the `rows × cols` shape the config implies.
type HostSource<'a> = dyn FnMut(WeightId, usize, usize) -> Result<TypedVec> + 'a;

/// The half-width of the uniform distribution of matrix entries: a standard deviation of
/// 0.02 (`half_width / √3`), transformers' `initializer_range` for Llama, keeps activations
/// in the range real weights give, so the timed kernels see ordinary numbers.
const MATRIX_HALF_WIDTH: f32 = 0.02 * 1.732_050_8;
/// RMSNorm weights are `1 ± 0.1`: near the identity, as trained ones mostly are.
const NORM_HALF_WIDTH: f32 = 0.1;
/// Elements per parallel task: big enough to amortize rayon's scheduling, small enough to
/// spread one matrix over every core.
const RANDOM_CHUNK: usize = 1 << 16;

/// `len` values of `center ± half_width` (uniform) in `dtype`, elements `2j` and `2j + 1`
/// from the two halves of one hash of `(key, j)`, so any element can be regenerated alone and
/// the result does not depend on the number of threads.
fn random_values(dtype: DType, len: usize, key: u64, center: f32, half_width: f32) -> TypedVec {
    match dtype {
        DType::F32 => TypedVec::F32(fill_random(len, key, center, half_width, |x| x)),
        DType::F16 => TypedVec::F16(fill_random(len, key, center, half_width, |x| {
            bytemuck::cast(f16_bits(x))
        })),
        DType::Bf16 => TypedVec::Bf16(fill_random(len, key, center, half_width, |x| {
            bytemuck::cast(bf16_bits(x))
        })),
    }
}

/// [`random_values`] with each value stored by `convert`.
fn fill_random<T: bytemuck::Pod + Send>(
    len: usize,
    key: u64,
    center: f32,
    half_width: f32,
    convert: impl Fn(f32) -> T + Sync,
) -> Vec<T> {
    // 24 of a half's 32 random bits to a value in (-1, 1), symmetric about 0.
    let scale = half_width / (1u32 << 23) as f32;
    let value =
        |half: u32| convert(center + (((half >> 8) as i32 - (1 << 23)) as f32 + 0.5) * scale);
    let mut out: Vec<T> = bytemuck::zeroed_vec(len);
    out.par_chunks_mut(RANDOM_CHUNK)
        .enumerate()
        .for_each(|(c, chunk)| {
            // Chunks hold an even number of elements, so pair `j` never straddles two.
            let mut pairs = chunk.chunks_exact_mut(2);
            let first = (c * RANDOM_CHUNK / 2) as u64;
            let mut j = first;
            for pair in &mut pairs {
                let h = splitmix64(key ^ j);
                pair[0] = value((h >> 32) as u32);
                pair[1] = value(h as u32);
                j += 1;
            }
            if let [last] = pairs.into_remainder() {
                *last = value((splitmix64(key ^ j) >> 32) as u32);
            }
        });
    out
}

/// The bits of the bf16 nearest to `x` (ties to even), which must be finite: `half`'s
/// conversion less its NaN branch, so that the generating loop stays branch-free.
fn bf16_bits(x: f32) -> u16 {
    let bits = x.to_bits();
    ((bits + 0x7fff + ((bits >> 16) & 1)) >> 16) as u16
}

/// The bits of the f16 nearest to `x` (ties to even; past 65520, infinity), which must be
/// finite: Fabian Giesen's `float_to_half_fast3_rtne`, with both paths computed and one
/// picked, so that the generating loop stays branch-free (`half` dispatches at run time for
/// each value, which takes longer than drawing it).
fn f16_bits(x: f32) -> u16 {
    let bits = x.to_bits();
    let sign = ((bits >> 16) & 0x8000) as u16;
    let abs = bits & 0x7fff_ffff;
    // Normal: rebias the exponent (127 to 15), round the 13 dropped bits to nearest even.
    let odd = (abs >> 13) & 1;
    let normal = abs.wrapping_sub(112 << 23).wrapping_add(0xfff + odd) >> 13;
    // Subnormal or zero: adding 0.5 lines the 10 mantissa bits up at the bottom of an f32,
    // rounded to nearest even by the addition itself.
    let subnormal = (f32::from_bits(abs) + 0.5)
        .to_bits()
        .wrapping_sub(0.5f32.to_bits());
    let magnitude = if abs < 0x3880_0000 { subnormal } else { normal };
    let magnitude = if abs >= 0x4780_0000 {
        0x7c00
    } else {
        magnitude
    };
    sign | magnitude as u16
}

/// `parts` (matrices of the same columns) as one, their rows in order, in the first part's
/// dtype.
fn stack_rows(mut parts: Vec<TypedVec>) -> TypedVec {
    if parts.len() == 1 {
        return parts.pop().expect("one part");
    }
    let dtype = parts[0].dtype();
    let mut out = TypedVec::zeros(dtype, parts.iter().map(TypedVec::len).sum());
    let mut at = 0;
    for part in parts {
        let part = if part.dtype() == dtype {
            part
        } else {
            TypedVec::from_f32(dtype, &part.to_f32_vec())
        };
        out.copy_from(at, &part);
        at += part.len();
    }
    out
}

/// The random data of weight `id` (`len` elements) for `seed`.
fn random_weight(dtype: DType, seed: u64, id: WeightId, len: usize) -> TypedVec {
    let key = splitmix64(splitmix64(seed) ^ id.ordinal());
    if id.is_norm() {
        random_values(dtype, len, key, 1.0, NORM_HALF_WIDTH)
    } else {
        random_values(dtype, len, key, 0.0, MATRIX_HALF_WIDTH)
    }
}

impl<B: LayerOps> ModelLayers<B> {
    /// Uploads `weights` (shaped as `config` says) through `backend`, moving each tensor.
    /// `on_layer` is called after each layer, for progress.
    pub fn upload(
        backend: &B,
        config: &LlamaConfig,
        weights: Weights,
        on_layer: &mut dyn FnMut(usize),
    ) -> Result<ModelLayers<B>> {
        let Weights {
            embed_tokens,
            layers,
            norm,
            lm_head,
        } = weights;
        if layers.len() != config.num_hidden_layers {
            return Err(RuntimeError::WeightShape {
                name: "model.layers".into(),
                shape: vec![layers.len()],
                expected: vec![config.num_hidden_layers],
            });
        }
        let with_lm_head = lm_head.is_some();
        let (mut embed, mut norm, mut lm_head) = (Some(embed_tokens), Some(norm), lm_head);
        // Each tensor is taken out when asked for, so it is freed (or kept, by a backend
        // whose memory is the host's) as soon as it is uploaded.
        let mut layers: Vec<[Option<HostTensor>; 9]> = layers
            .into_iter()
            .map(|l| {
                [
                    l.input_norm,
                    l.q_proj,
                    l.k_proj,
                    l.v_proj,
                    l.o_proj,
                    l.post_attention_norm,
                    l.gate_proj,
                    l.up_proj,
                    l.down_proj,
                ]
                .map(Some)
            })
            .collect();
        let mut source = |id: WeightId, rows: usize, cols: usize| {
            let tensor = match id {
                WeightId::Embed => embed.take(),
                WeightId::Layer(l, p) => layers.get_mut(l).and_then(|l| l[p as usize].take()),
                WeightId::FinalNorm => norm.take(),
                WeightId::LmHead => lm_head.take(),
            };
            match tensor {
                Some(t) if t.len() == rows * cols => Ok(t.data),
                t => Err(RuntimeError::WeightShape {
                    name: id.name(),
                    shape: t.map(|t| t.shape).unwrap_or_default(),
                    expected: vec![rows, cols],
                }),
            }
        };
        Self::build(backend, config, with_lm_head, &mut source, on_layer)
    }

    /// Uploads random weights of `config`'s shapes as `dtype`, for timing a model without its
    /// weights. Each matrix is drawn on the host (on every core) just before its upload, so
    /// the host holds at most one beyond what the backend keeps: an 8B model never needs its
    /// 16 GB there at once. The values depend on `seed` alone, so every device, rank and
    /// thread count gets the same model.
    pub fn random(
        backend: &B,
        config: &LlamaConfig,
        dtype: DType,
        seed: u64,
        on_layer: &mut dyn FnMut(usize),
    ) -> Result<ModelLayers<B>> {
        config.validate()?;
        let mut source = |id: WeightId, rows: usize, cols: usize| {
            Ok(random_weight(dtype, seed, id, rows * cols))
        };
        Self::build(
            backend,
            config,
            !config.tie_word_embeddings,
            &mut source,
            on_layer,
        )
    }

    /// Uploads every weight `source` gives, in layer order, then the embedding, the final
    /// norm and, `with_lm_head`, the output projection (else it is tied to the embedding).
    fn build(
        backend: &B,
        config: &LlamaConfig,
        with_lm_head: bool,
        source: &mut HostSource,
        on_layer: &mut dyn FnMut(usize),
    ) -> Result<ModelLayers<B>> {
        // Weights with the same columns, their rows stacked in the order given.
        let mut upload = |ids: &[WeightId]| -> Result<B::Weight> {
            let (mut rows, mut cols, mut parts) = (0, 0, Vec::with_capacity(ids.len()));
            for &id in ids {
                let (r, c) = id.shape(config);
                parts.push(source(id, r, c)?);
                (rows, cols) = (rows + r, c);
            }
            Ok(backend.upload_weight(stack_rows(parts), rows, cols)?)
        };
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for l in 0..config.num_hidden_layers {
            let mut parts = |ps: &[Part]| {
                let ids: Vec<WeightId> = ps.iter().map(|&p| WeightId::Layer(l, p)).collect();
                upload(&ids)
            };
            layers.push(LayerWeights {
                input_norm: parts(&[Part::InputNorm])?,
                qkv: parts(&[Part::Q, Part::K, Part::V])?,
                o: parts(&[Part::O])?,
                post_norm: parts(&[Part::PostNorm])?,
                gate_up: parts(&[Part::Gate, Part::Up])?,
                down: parts(&[Part::Down])?,
            });
            on_layer(l);
        }
        let inv_freq: Vec<f32> = config
            .rope_inv_freq()
            .into_iter()
            .map(|f| f as f32)
            .collect();
        let half = inv_freq.len();
        Ok(ModelLayers {
            config: config.clone(),
            embed: upload(&[WeightId::Embed])?,
            lm_head: with_lm_head
                .then(|| upload(&[WeightId::LmHead]))
                .transpose()?,
            norm: upload(&[WeightId::FinalNorm])?,
            layers,
            inv_freq: backend.upload_weight(TypedVec::F32(inv_freq), 1, half)?,
        })
    }

    /// The attention shape every layer shares.
    pub fn attn_shape(&self) -> AttnShape {
        self.config.attn_shape()
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// The embedding rows of `ids`: the hidden states entering layer 0.
    pub fn embed(&self, b: &B, ids: &[u32]) -> Result<B::Tensor> {
        let mut x = b.output_tensor(ids.len(), self.config.hidden_size)?;
        b.embed(&self.embed, ids, &mut x)?;
        Ok(x)
    }

    /// Layer `l`'s rotated queries, keys and values of the hidden rows `x` at `positions`;
    /// with `store`, the keys and values of its `(row, slot)` pairs are also written into
    /// those slots of the layer's cache, in the same op as the rotation.
    pub fn qkv(
        &self,
        b: &B,
        l: usize,
        x: &B::Tensor,
        positions: &[u32],
        store: Option<KvStore<'_, B>>,
    ) -> Result<Qkv<B>> {
        let rows = b.dims(x).0;
        let mut scratch = self.qkv_scratch(b, rows)?;
        let mut q = self.query_rows(b, rows)?;
        self.qkv_with(b, l, x, positions, store, &mut scratch, &mut q)?;
        let QkvScratch { k, v, .. } = scratch;
        Ok(Qkv { q, k, v })
    }

    /// [`ModelLayers::qkv`] into `q` and `scratch` (whose keys and values it leaves there),
    /// allocating nothing.
    #[allow(clippy::too_many_arguments)]
    pub fn qkv_with(
        &self,
        b: &B,
        l: usize,
        x: &B::Tensor,
        positions: &[u32],
        store: Option<KvStore<'_, B>>,
        scratch: &mut QkvScratch<B>,
        q: &mut B::Tensor,
    ) -> Result<()> {
        let (c, layer) = (&self.config, &self.layers[l]);
        let s = scratch;
        let norm = (&layer.input_norm, c.rms_norm_eps as f32);
        let scratch = (&mut s.operand, &mut s.fused);
        let outputs = (q, &mut s.k, &mut s.v);
        let freq = &self.inv_freq;
        b.rms_norm_matmul_rope(
            x, norm, &layer.qkv, scratch, positions, freq, outputs, store,
        )?;
        Ok(())
    }

    /// Query rows (`rows × q_heads · head_dim`) for [`ModelLayers::qkv_with`] to write.
    pub fn query_rows(&self, b: &B, rows: usize) -> Result<B::Tensor> {
        Ok(b.output_tensor(rows, self.attn_shape().q_row_elems())?)
    }

    /// [`ModelLayers::qkv_with`]'s activations of `rows` rows.
    pub fn qkv_scratch(&self, b: &B, rows: usize) -> Result<QkvScratch<B>> {
        let c = &self.config;
        let kvn = c.num_key_value_heads * c.head_dim;
        let weight = self.layers.first().map_or(&self.norm, |layer| &layer.qkv);
        Ok(QkvScratch {
            operand: b.gemm_operand(rows, c.hidden_size, weight)?,
            fused: b.output_tensor(rows, self.attn_shape().q_row_elems() + 2 * kvn)?,
            k: b.output_tensor(rows, kvn)?,
            v: b.output_tensor(rows, kvn)?,
        })
    }

    /// [`ModelLayers::finish_states`]' activations of `rows` rows.
    pub fn mlp_scratch(&self, b: &B, rows: usize) -> Result<MlpScratch<B>> {
        let c = &self.config;
        let (gate_up, down) = self
            .layers
            .first()
            .map_or((&self.norm, &self.norm), |layer| {
                (&layer.gate_up, &layer.down)
            });
        Ok(MlpScratch {
            operand: b.gemm_operand(rows, c.hidden_size, gate_up)?,
            act: b.gemm_operand(rows, c.intermediate_size, down)?,
        })
    }

    /// An attention output of `rows` rows for [`ModelLayers::finish`] to read (written by
    /// `states_output`): a GEMM operand of the output projection.
    pub fn attention_output(&self, b: &B, rows: usize) -> Result<B::Tensor> {
        let cols = self.attn_shape().q_row_elems();
        Ok(match self.layers.first() {
            Some(layer) => b.gemm_operand(rows, cols, &layer.o)?,
            None => b.output_tensor(rows, cols)?,
        })
    }

    /// The rest of layer `l` in place on the hidden rows `x`, given its attention output
    /// (`rows × q_heads · head_dim`): the output projection and residual, then the MLP and
    /// its residual.
    pub fn finish(&self, b: &B, l: usize, x: &mut B::Tensor, attn: &B::Tensor) -> Result<()> {
        let mut scratch = self.mlp_scratch(b, b.dims(x).0)?;
        b.matmul_add(attn, &self.layers[l].o, x)?;
        self.mlp(b, l, x, &mut scratch)
    }

    /// [`ModelLayers::finish`] of the attention's states, the MLP's activations in `scratch`:
    /// the output projection reads the states' outputs, through `attn`
    /// ([`ModelLayers::attention_output`]'s) where it must.
    pub fn finish_states(
        &self,
        b: &B,
        l: usize,
        x: &mut B::Tensor,
        states: &B::States,
        attn: &mut B::Tensor,
        scratch: &mut MlpScratch<B>,
    ) -> Result<()> {
        b.states_matmul_add(states, &self.layers[l].o, attn, x)?;
        self.mlp(b, l, x, scratch)
    }

    /// Layer `l`'s MLP and its residual, in place on `x`.
    fn mlp(&self, b: &B, l: usize, x: &mut B::Tensor, s: &mut MlpScratch<B>) -> Result<()> {
        let (c, layer) = (&self.config, &self.layers[l]);
        let norm = (&layer.post_norm, c.rms_norm_eps as f32);
        b.rms_norm_matmul_swiglu(x, norm, &layer.gate_up, &mut s.operand, &mut s.act)?;
        b.matmul_add(&s.act, &layer.down, x)?;
        Ok(())
    }

    /// Next-token logits (`rows.len() × vocab`, on the host) of the last layer's hidden rows
    /// `rows` of `x`.
    pub fn logits(&self, b: &B, x: &B::Tensor, rows: &[usize]) -> Result<Vec<f32>> {
        let mut out = b.tensor(rows.len(), self.config.vocab_size)?;
        self.logits_into(b, x, rows, &mut out)?;
        Ok(b.download_tensor(&out)?)
    }

    /// [`ModelLayers::logits`], left in `out` (`rows.len() × vocab`) on the backend.
    pub fn logits_into(
        &self,
        b: &B,
        x: &B::Tensor,
        rows: &[usize],
        out: &mut B::Tensor,
    ) -> Result<()> {
        let c = &self.config;
        let mut picked = b.tensor(rows.len(), c.hidden_size)?;
        b.gather_rows(x, rows, &mut picked)?;
        let rows = rows.len();
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        let mut normed = b.gemm_operand(rows, c.hidden_size, head)?;
        let norm = (&self.norm, c.rms_norm_eps as f32);
        b.rms_norm_matmul(&picked, norm, head, &mut normed, out)?;
        Ok(())
    }
}

/// What running `config`'s model with `weight_dtype` weights asks of a device (checked by
/// [`LayerOps::check_model`] before the weights are uploaded): every weight, `kv_tokens`
/// tokens of `kv_dtype` KV, activations of `max_rows` rows (attention over rows of its own
/// keys, as a server's chunks and decode steps run it) and logits of `logit_rows`.
pub(crate) fn model_needs(
    config: &LlamaConfig,
    weight_dtype: DType,
    kv_dtype: DType,
    kv_tokens: usize,
    max_rows: usize,
    logit_rows: usize,
) -> ModelNeeds {
    ModelNeeds {
        shape: config.attn_shape(),
        hidden: config.hidden_size,
        intermediate: config.intermediate_size,
        vocab: config.vocab_size,
        layers: config.num_hidden_layers,
        weight_dtype,
        weight_bytes: config.weight_bytes(weight_dtype),
        kv_dtype,
        kv_tokens,
        max_rows,
        attention_rows: max_rows,
        attention_keys: 0,
        logit_rows,
        peer_devices: 0,
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use canopy_engine::CpuBackend;
    use canopy_model::LayerWeights as HostLayer;

    /// A small GQA model: 2 layers, 4 query heads on 2 KV heads of 16.
    pub(crate) fn tiny(tied: bool) -> LlamaConfig {
        LlamaConfig {
            vocab_size: 97,
            hidden_size: 64,
            intermediate_size: 96,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 16,
            rms_norm_eps: 1e-5,
            rope_theta: 10000.0,
            rope_scaling: None,
            max_position_embeddings: 128,
            tie_word_embeddings: tied,
            bos_token_id: None,
            eos_token_ids: Vec::new(),
        }
    }

    /// Logits of three tokens after every layer, with each layer's queries standing in for
    /// its attention output (same shape): the shapes of every weight are exercised, and the
    /// attention itself is not this module's.
    fn logits(layers: &ModelLayers<CpuBackend>) -> Vec<f32> {
        let b = &CpuBackend;
        let mut x = layers.embed(b, &[1, 5, 96]).unwrap();
        for l in 0..layers.num_layers() {
            let qkv = layers.qkv(b, l, &x, &[0, 1, 2], None).unwrap();
            layers.finish(b, l, &mut x, &qkv.q).unwrap();
        }
        layers.logits(b, &x, &[0, 1, 2]).unwrap()
    }

    fn random(config: &LlamaConfig, dtype: DType, seed: u64) -> ModelLayers<CpuBackend> {
        ModelLayers::random(&CpuBackend, config, dtype, seed, &mut |_| {}).unwrap()
    }

    #[test]
    fn random_weights_run_and_depend_on_the_seed_only() {
        for tied in [false, true] {
            let config = tiny(tied);
            let mut seen = Vec::new();
            let layers =
                ModelLayers::random(&CpuBackend, &config, DType::F32, 7, &mut |l| seen.push(l))
                    .unwrap();
            assert_eq!(seen, [0, 1]);
            assert_eq!(layers.lm_head.is_some(), !tied);
            let a = logits(&layers);
            assert_eq!(a.len(), 3 * config.vocab_size);
            assert!(a.iter().all(|x| x.is_finite()), "tied {tied}");
            assert!(a.iter().any(|&x| x != 0.0));
            assert_eq!(a, logits(&random(&config, DType::F32, 7)), "tied {tied}");
            assert_ne!(a, logits(&random(&config, DType::F32, 8)), "tied {tied}");
        }
        let bf16 = logits(&random(&tiny(false), DType::Bf16, 7));
        assert!(bf16.iter().all(|x| x.is_finite()));
    }

    #[test]
    fn random_refuses_an_invalid_config() {
        let mut config = tiny(false);
        config.num_key_value_heads = 3;
        let err =
            ModelLayers::<CpuBackend>::random(&CpuBackend, &config, DType::F32, 0, &mut |_| {})
                .err()
                .unwrap();
        assert!(err.to_string().contains("shared evenly"), "{err}");
    }

    /// Random values are centred where asked, spread as asked and rounded as `dtype` rounds.
    #[test]
    fn random_values_have_their_distribution() {
        let n = 1 << 18;
        let values = random_values(DType::F32, n, 3, 0.0, MATRIX_HALF_WIDTH).to_f32_vec();
        let mean = values.iter().sum::<f32>() / n as f32;
        let std = (values.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / n as f32).sqrt();
        assert!(mean.abs() < 5e-4, "mean {mean}");
        assert!((std - 0.02).abs() < 2e-4, "std {std}");
        assert!(values.iter().all(|x| x.abs() < MATRIX_HALF_WIDTH));
        let norms = random_values(DType::F32, n, 3, 1.0, NORM_HALF_WIDTH).to_f32_vec();
        assert!(norms.iter().all(|x| (0.9..=1.1).contains(x)));
        for dtype in [DType::F16, DType::Bf16] {
            let rounded = random_values(dtype, n, 3, 0.0, MATRIX_HALF_WIDTH).to_f32_vec();
            let want: Vec<f32> = values.iter().map(|&x| dtype.round(x)).collect();
            assert_eq!(rounded, want, "{dtype}");
        }
    }

    /// The branch-free conversions agree bit for bit with `half`'s on finite values: normal,
    /// subnormal, ties, overflow to infinity, both signs.
    #[test]
    fn conversions_match_half() {
        let values: Vec<f32> = (0..=u32::MAX)
            .step_by(4093)
            .map(f32::from_bits)
            .chain([
                0.0,
                -0.0,
                65504.0,
                65519.99,
                65520.0,
                1e-8,
                2.0f32.powi(-25),
                1.0 + 2.0f32.powi(-11),
            ])
            .filter(|x| x.is_finite())
            .collect();
        for (dtype, ours) in [
            (DType::F16, f16_bits as fn(f32) -> u16),
            (DType::Bf16, bf16_bits),
        ] {
            let want = TypedVec::from_f32(dtype, &values);
            let want: &[u16] = bytemuck::cast_slice(want.as_bytes());
            for (x, &w) in values.iter().zip(want) {
                assert_eq!(ours(*x), w, "{dtype} of {x:e}");
            }
        }
    }

    /// The host weights `random` draws for `config`, as a loaded model would hold them.
    fn host_weights(config: &LlamaConfig, seed: u64) -> Weights {
        let tensor = |id: WeightId| {
            let (rows, cols) = id.shape(config);
            HostTensor {
                shape: if rows == 1 {
                    vec![cols]
                } else {
                    vec![rows, cols]
                },
                data: random_weight(DType::F32, seed, id, rows * cols),
            }
        };
        let layers = (0..config.num_hidden_layers)
            .map(|l| {
                let part = |p| tensor(WeightId::Layer(l, p));
                HostLayer {
                    input_norm: part(Part::InputNorm),
                    q_proj: part(Part::Q),
                    k_proj: part(Part::K),
                    v_proj: part(Part::V),
                    o_proj: part(Part::O),
                    post_attention_norm: part(Part::PostNorm),
                    gate_proj: part(Part::Gate),
                    up_proj: part(Part::Up),
                    down_proj: part(Part::Down),
                }
            })
            .collect();
        Weights {
            embed_tokens: tensor(WeightId::Embed),
            layers,
            norm: tensor(WeightId::FinalNorm),
            lm_head: (!config.tie_word_embeddings).then(|| tensor(WeightId::LmHead)),
        }
    }

    /// Both sources go through one builder: the same tensors give the same model.
    #[test]
    fn upload_puts_each_tensor_where_random_does() {
        for tied in [false, true] {
            let config = tiny(tied);
            let mut seen = Vec::new();
            let uploaded =
                ModelLayers::upload(&CpuBackend, &config, host_weights(&config, 11), &mut |l| {
                    seen.push(l)
                })
                .unwrap();
            assert_eq!(seen, [0, 1]);
            assert_eq!(
                logits(&uploaded),
                logits(&random(&config, DType::F32, 11)),
                "tied {tied}"
            );
        }
    }

    #[test]
    fn upload_refuses_a_misshapen_tensor_or_missing_layer() {
        let config = tiny(false);
        let mut weights = host_weights(&config, 0);
        weights.layers[1].k_proj = weights.layers[1].q_proj.clone();
        let err = ModelLayers::<CpuBackend>::upload(&CpuBackend, &config, weights, &mut |_| {})
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("layer 1 k_proj has shape [64, 64]") && err.contains("[32, 64]"),
            "{err}"
        );
        let mut weights = host_weights(&config, 0);
        weights.layers.pop();
        let err = ModelLayers::<CpuBackend>::upload(&CpuBackend, &config, weights, &mut |_| {})
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("model.layers has shape [1]"), "{err}");
    }
}
