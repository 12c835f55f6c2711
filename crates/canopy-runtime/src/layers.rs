//! A Llama decoder's layers around attention, on any backend that implements
//! [`LayerOps`]: everything a token's hidden state goes through except the attention itself,
//! which depends on where the KV lives (the engine's business, see [`crate::rank`]).
//!
//! The weights are uploaded once per device ([`ModelLayers::upload`], from a model's file or
//! drawn at random with its shapes by [`crate::RandomWeights`], to time a model without its
//! weights) and shared by every rank on it; each call takes the calling rank's backend, whose
//! stream orders its work.

use crate::Result;
use canopy_core::{AttnShape, CodedSliceMut, DType, TypedSliceMut, TypedVec, WeightPart};
use canopy_engine::{LayerOps, ModelNeeds};
use canopy_model::{LayerPart, LlamaConfig, WeightId, WeightSource};
use std::time::Instant;

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

/// The weights [`ModelLayers`] uploads as one matrix, in upload order: a layer's (the
/// projections that read the same input stacked), then the embedding, the output projection
/// (unless tied) and the final norm.
fn upload_groups(config: &LlamaConfig, with_lm_head: bool) -> Vec<Vec<WeightId>> {
    use LayerPart::*;
    let mut groups = Vec::new();
    for l in 0..config.num_hidden_layers {
        for parts in [
            &[InputNorm][..],
            &[Q, K, V],
            &[O],
            &[PostNorm],
            &[Gate, Up],
            &[Down],
        ] {
            groups.push(parts.iter().map(|&p| WeightId::Layer(l, p)).collect());
        }
    }
    groups.push(vec![WeightId::Embed]);
    if with_lm_head {
        groups.push(vec![WeightId::LmHead]);
    }
    groups.push(vec![WeightId::FinalNorm]);
    groups
}

/// The `(rows, cols)` of `ids` (weights that share their columns) stacked in order.
fn stack_shape(config: &LlamaConfig, ids: &[WeightId]) -> (usize, usize) {
    let shapes = ids.iter().map(|id| id.matrix_shape(config));
    let rows = shapes.clone().map(|(r, _)| r).sum();
    (rows, shapes.map(|(_, c)| c).next().unwrap_or(0))
}

/// A part of a weight that a source writes.
trait ReadPart: WeightPart {
    /// Writes elements `first..first + self.len()` of weight `id` from `weights`.
    fn read(self, weights: &dyn WeightSource, id: WeightId, first: usize) -> Result<()>;
}

impl ReadPart for TypedSliceMut<'_> {
    fn read(self, weights: &dyn WeightSource, id: WeightId, first: usize) -> Result<()> {
        Ok(weights.read_part(id, first, self)?)
    }
}

impl ReadPart for CodedSliceMut<'_> {
    fn read(self, weights: &dyn WeightSource, id: WeightId, first: usize) -> Result<()> {
        Ok(weights.read_codes(id, first, self)?)
    }
}

/// `read()`, its seconds added to `seconds`.
fn timed<T>(seconds: &mut f64, read: impl FnOnce() -> T) -> T {
    let t0 = Instant::now();
    let out = read();
    *seconds += t0.elapsed().as_secs_f64();
    out
}

/// The group in which every weight of `ids` can be read as codes, stacked: the smallest of
/// their groups, which the others are multiples of (16 or 32). `None` if any cannot be.
fn stack_code_group(weights: &dyn WeightSource, ids: &[WeightId]) -> Option<usize> {
    let groups: Option<Vec<usize>> = ids.iter().map(|&id| weights.code_group(id)).collect();
    let groups = groups?;
    let smallest = *groups.iter().min()?;
    groups
        .iter()
        .all(|g| g.is_multiple_of(smallest))
        .then_some(smallest)
}

/// Writes elements `first..first + out.len()` of the stack of `ids` (their rows in order)
/// from `weights` into `out`: the part of each weight that the range covers.
fn read_stack_part<P: ReadPart>(
    weights: &dyn WeightSource,
    config: &LlamaConfig,
    ids: &[WeightId],
    first: usize,
    out: P,
) -> Result<()> {
    let end = first + out.len();
    let (mut rest, mut start) = (out, 0);
    for &id in ids {
        let (rows, cols) = id.matrix_shape(config);
        let (from, to) = (first.max(start), end.min(start + rows * cols));
        if from < to {
            let (part, after) = rest.split_at_mut(to - from);
            part.read(weights, id, from - start)?;
            rest = after;
        }
        start += rows * cols;
    }
    Ok(())
}

/// Bytes (in the compute dtype) of the groups after the one being read that the reader has
/// asked its source to bring in from the disk ([`WeightSource::prefetch`]): two of an 8B
/// model's layers in bf16, so the disk always has reads queued while the reader copies. A
/// quantized file's share of them is smaller.
const PREFETCH_BYTES: usize = 512 << 20;

/// Asks a source for the groups ahead of the reader, each once, `budget` bytes ahead.
struct Prefetcher<'a> {
    weights: &'a dyn WeightSource,
    groups: &'a [Vec<WeightId>],
    bytes: Vec<usize>,
    budget: usize,
    /// Groups before this one have been asked for.
    asked: usize,
}

impl<'a> Prefetcher<'a> {
    fn new(
        weights: &'a dyn WeightSource,
        config: &LlamaConfig,
        groups: &'a [Vec<WeightId>],
        budget: usize,
    ) -> Self {
        let size = weights.dtype().size_bytes();
        let bytes = groups
            .iter()
            .map(|ids| {
                let (rows, cols) = stack_shape(config, ids);
                rows * cols * size
            })
            .collect();
        Prefetcher {
            weights,
            groups,
            bytes,
            budget,
            asked: 0,
        }
    }

    /// Before group `reading` is read: it, and the groups after it until they hold `budget`
    /// bytes.
    fn ahead_of(&mut self, reading: usize) {
        while self.asked < self.groups.len()
            && (self.asked <= reading
                || self.bytes[reading + 1..self.asked].iter().sum::<usize>() < self.budget)
        {
            for &id in &self.groups[self.asked] {
                self.weights.prefetch(id);
            }
            self.asked += 1;
        }
    }
}

impl<B: LayerOps> ModelLayers<B> {
    /// Uploads `config`'s model through `backend`, each weight read from `weights` a part at
    /// a time, straight into the memory the backend copies from
    /// ([`LayerOps::upload_weight_with`]), while the disk reads ahead
    /// ([`WeightSource::prefetch`]); returns once every weight has landed. `on_layer` is
    /// called after each layer, for progress.
    pub fn upload(
        backend: &B,
        config: &LlamaConfig,
        weights: &dyn WeightSource,
        on_layer: &mut dyn FnMut(usize),
    ) -> Result<ModelLayers<B>> {
        config.validate()?;
        let with_lm_head = weights.has_lm_head();
        let groups = upload_groups(config, with_lm_head);
        let started = Instant::now();
        let (mut read_s, mut bytes) = (0.0, 0usize);
        let layers = {
            let mut prefetcher = Prefetcher::new(weights, config, &groups, PREFETCH_BYTES);
            let mut group = 0;
            let mut next = || -> Result<B::Weight> {
                prefetcher.ahead_of(group);
                let ids = &groups[group];
                group += 1;
                let shape = stack_shape(config, ids);
                if let Some(group) = stack_code_group(weights, ids) {
                    let coded = backend.upload_coded_weight(shape, group, &mut |first, part| {
                        timed(&mut read_s, || {
                            read_stack_part(weights, config, ids, first, part)
                        })
                    });
                    if let Some(coded) = coded {
                        // A code a byte, and an f32 step and offset a group.
                        bytes += shape.0 * shape.1 * (group + 8) / group;
                        return coded;
                    }
                }
                bytes += shape.0 * shape.1 * weights.dtype().size_bytes();
                backend.upload_weight_with(weights.dtype(), shape, &mut |first, part| {
                    timed(&mut read_s, || {
                        read_stack_part(weights, config, ids, first, part)
                    })
                })
            };
            let mut layers = Vec::with_capacity(config.num_hidden_layers);
            for l in 0..config.num_hidden_layers {
                layers.push(LayerWeights {
                    input_norm: next()?,
                    qkv: next()?,
                    o: next()?,
                    post_norm: next()?,
                    gate_up: next()?,
                    down: next()?,
                });
                on_layer(l);
            }
            let embed = next()?;
            let lm_head = with_lm_head.then(&mut next).transpose()?;
            let norm = next()?;
            let inv_freq: Vec<f32> = config
                .rope_inv_freq()
                .into_iter()
                .map(|f| f as f32)
                .collect();
            let half = inv_freq.len();
            backend.finish_uploads()?;
            ModelLayers {
                config: config.clone(),
                embed,
                lm_head,
                norm,
                layers,
                inv_freq: backend.upload_weight(&TypedVec::F32(inv_freq), 1, half)?,
            }
        };
        let seconds = started.elapsed().as_secs_f64();
        tracing::info!(
            backend = backend.name(),
            gb = bytes as f64 / 1e9,
            seconds,
            gb_per_s = bytes as f64 / 1e9 / seconds,
            read_s,
            "weights uploaded"
        );
        Ok(layers)
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
        self.finish_output(b, l, x, attn, &mut scratch)
    }

    /// [`ModelLayers::finish`], the MLP's activations in `scratch`.
    pub fn finish_output(
        &self,
        b: &B,
        l: usize,
        x: &mut B::Tensor,
        attn: &B::Tensor,
        scratch: &mut MlpScratch<B>,
    ) -> Result<()> {
        b.matmul_add(attn, &self.layers[l].o, x)?;
        self.mlp(b, l, x, scratch)
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

    /// Runs layer 0's products (and the LM head, up to `logit_rows` rows) once at each row
    /// count the backend's products run at for 1 to `max_rows` rows
    /// ([`LayerOps::product_rows`]), on rows of zeros, and throws the results away: a backend
    /// that sets a product up on its first use at a shape does it now rather than inside a
    /// client's step. cuBLAS picks its kernel by the product's rows and loads each kernel
    /// the first time it runs, a few milliseconds each on an H200, and a server's steps run
    /// every row count up to its batch and prompt chunk.
    pub fn warm_up_products(&self, b: &B, max_rows: usize, logit_rows: usize) -> Result<()> {
        if self.layers.is_empty() {
            return Ok(());
        }
        let c = &self.config;
        let cols = self.attn_shape().q_row_elems();
        let mut counts: Vec<usize> = (1..=max_rows).map(|n| b.product_rows(n)).collect();
        counts.dedup();
        for n in counts {
            let mut x = b.tensor(n, c.hidden_size)?;
            self.qkv(b, 0, &x, &vec![0; n], None)?;
            self.finish(b, 0, &mut x, &b.tensor(n, cols)?)?;
            if n <= logit_rows {
                let mut logits = b.output_tensor(n, c.vocab_size)?;
                self.logits_into(b, &x, &(0..n).collect::<Vec<_>>(), &mut logits)?;
            }
        }
        Ok(b.synchronize()?)
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
        ranks_here: 1,
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::RandomWeights;
    use canopy_core::TypedSliceMut;
    use canopy_engine::CpuBackend;

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
        let weights = RandomWeights::new(config, dtype, seed);
        ModelLayers::upload(&CpuBackend, config, &weights, &mut |_| {}).unwrap()
    }

    #[test]
    fn random_weights_run_and_depend_on_the_seed_only() {
        for tied in [false, true] {
            let config = tiny(tied);
            let mut seen = Vec::new();
            let weights = RandomWeights::new(&config, DType::F32, 7);
            let layers =
                ModelLayers::upload(&CpuBackend, &config, &weights, &mut |l| seen.push(l)).unwrap();
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
    fn upload_refuses_an_invalid_config() {
        let mut config = tiny(false);
        config.num_key_value_heads = 3;
        let weights = RandomWeights::new(&config, DType::F32, 0);
        let err = ModelLayers::<CpuBackend>::upload(&CpuBackend, &config, &weights, &mut |_| {})
            .err()
            .unwrap();
        assert!(err.to_string().contains("shared evenly"), "{err}");
    }

    /// Random weights that count their reads, fail the read of `fails` if given, and record
    /// the prefetch hints they are given.
    struct Watched {
        weights: RandomWeights,
        fails: Option<WeightId>,
        reads: std::sync::atomic::AtomicUsize,
        asked: std::sync::Mutex<Vec<WeightId>>,
    }

    impl Watched {
        fn new(config: &LlamaConfig, fails: Option<WeightId>) -> Watched {
            Watched {
                weights: RandomWeights::new(config, DType::F32, 0),
                fails,
                reads: Default::default(),
                asked: Default::default(),
            }
        }
    }

    impl WeightSource for Watched {
        fn has_lm_head(&self) -> bool {
            self.weights.has_lm_head()
        }

        fn dtype(&self) -> DType {
            self.weights.dtype()
        }

        fn read_part(
            &self,
            id: WeightId,
            first: usize,
            out: TypedSliceMut,
        ) -> canopy_model::Result<()> {
            self.reads
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if Some(id) == self.fails {
                return Err(canopy_model::ModelError::MissingTensor {
                    path: "model.gguf".into(),
                    tensor: id.name(),
                });
            }
            self.weights.read_part(id, first, out)
        }

        fn prefetch(&self, id: WeightId) {
            self.asked.lock().unwrap().push(id);
        }
    }

    #[test]
    fn a_read_error_ends_the_upload_and_the_reading() {
        let config = tiny(false);
        let weights = Watched::new(&config, Some(WeightId::Layer(1, LayerPart::K)));
        let err = ModelLayers::<CpuBackend>::upload(&CpuBackend, &config, &weights, &mut |_| {})
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("layer 1 k_proj"), "{err}");
        // Layer 0's nine weights, then layer 1's input norm, q and k: nothing after the bad one.
        assert_eq!(weights.reads.into_inner(), 12);
    }

    /// A stack read in parts of any size, which cross the weights' boundaries, holds each
    /// weight as read alone.
    #[test]
    fn stacks_read_in_parts_hold_each_weight_as_read_alone() {
        let config = tiny(false);
        for dtype in [DType::Bf16, DType::F32] {
            let weights = RandomWeights::new(&config, dtype, 3);
            for ids in upload_groups(&config, true) {
                let mut alone = Vec::new();
                for &id in &ids {
                    let (r, c) = id.matrix_shape(&config);
                    let mut one = TypedVec::zeros(dtype, r * c);
                    weights.read_part(id, 0, one.slice_mut(0..r * c)).unwrap();
                    alone.extend(one.to_f32_vec());
                }
                let (rows, cols) = stack_shape(&config, &ids);
                assert_eq!(rows * cols, alone.len());
                for part_len in [1, 7, 1000, alone.len()] {
                    let mut stack = TypedVec::zeros(dtype, alone.len());
                    let mut first = 0;
                    while first < alone.len() {
                        let n = part_len.min(alone.len() - first);
                        let part = stack.slice_mut(first..first + n);
                        read_stack_part(&weights, &config, &ids, first, part).unwrap();
                        first += n;
                    }
                    assert_eq!(stack.to_f32_vec(), alone, "{ids:?} in parts of {part_len}");
                }
            }
        }
    }

    /// Before each group is read, it and the fewest groups after it that hold the budget have
    /// been asked for; every weight is asked for once, in upload order.
    #[test]
    fn the_reader_asks_for_each_weight_once_a_budget_ahead() {
        let config = tiny(false);
        let source = Watched::new(&config, None);
        let groups = upload_groups(&config, true);
        let budget = 2 * config.intermediate_size * config.hidden_size * 4;
        let mut prefetcher = Prefetcher::new(&source, &config, &groups, budget);
        for i in 0..groups.len() {
            prefetcher.ahead_of(i);
            let asked = prefetcher.asked;
            let after = |end: usize| prefetcher.bytes[i + 1..end].iter().sum::<usize>();
            assert!(asked > i, "group {i} is asked for before it is read");
            assert!(asked == groups.len() || after(asked) >= budget, "group {i}");
            assert!(
                asked == i + 1 || after(asked - 1) < budget,
                "group {i}: no more than needed"
            );
        }
        let flat: Vec<WeightId> = groups.iter().flatten().copied().collect();
        assert_eq!(*source.asked.lock().unwrap(), flat);

        let upload = Watched::new(&config, None);
        ModelLayers::upload(&CpuBackend, &config, &upload, &mut |_| {}).unwrap();
        assert_eq!(upload.asked.into_inner().unwrap(), flat);
    }

    /// A source that offers its weights in f32 only.
    struct InF32<'a>(&'a dyn WeightSource);

    impl WeightSource for InF32<'_> {
        fn has_lm_head(&self) -> bool {
            self.0.has_lm_head()
        }
        fn dtype(&self) -> DType {
            self.0.dtype()
        }
        fn read_part(
            &self,
            id: WeightId,
            first: usize,
            out: TypedSliceMut,
        ) -> canopy_model::Result<()> {
            self.0.read_part(id, first, out)
        }
    }

    /// A K-quant GGUF's weights, uploaded to the CPU, are kept as codes that decode to the
    /// values read in f32 bit for bit: stacks of types of groups of 16 and 32, Q and K rows
    /// in transformers' order, the embedding and the output projection; the norms stay f32.
    #[test]
    fn coded_weights_decode_to_the_values_read_in_f32() {
        use canopy_engine::CpuWeight;
        let file = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/kquant/model.gguf");
        let model = canopy_model::Model::load(&file, DType::F32).expect("the fixture loads");
        let upload = |weights: &dyn WeightSource| {
            ModelLayers::upload(&CpuBackend, &model.config, weights, &mut |_| {}).unwrap()
        };
        let (coded, dense) = (upload(&model.weights), upload(&InF32(&model.weights)));
        let same_values = |coded: &CpuWeight, dense: &CpuWeight| match (coded, dense) {
            (CpuWeight::Coded(c), CpuWeight::Dense(d)) => {
                let mut row = vec![f32::NAN; c.cols];
                for (r, want) in d.data.chunks_exact(c.cols).enumerate() {
                    c.decode_row(r, &mut row);
                    assert!(row
                        .iter()
                        .zip(want)
                        .all(|(a, b)| a.to_bits() == b.to_bits()));
                }
                c.group()
            }
            other => panic!("a coded and a dense weight, not {other:?}"),
        };
        let (coded_head, dense_head) = (coded.lm_head.as_ref(), dense.lm_head.as_ref());
        let mut groups = vec![
            same_values(&coded.embed, &dense.embed),
            same_values(coded_head.unwrap(), dense_head.unwrap()),
        ];
        for (c, d) in coded.layers.iter().zip(&dense.layers) {
            for (c, d) in [(&c.qkv, &d.qkv), (&c.o, &d.o), (&c.gate_up, &d.gate_up)] {
                groups.push(same_values(c, d));
            }
            groups.push(same_values(&c.down, &d.down));
            for norm in [&c.input_norm, &c.post_norm] {
                assert!(matches!(norm, CpuWeight::Dense(_)));
            }
        }
        groups.sort_unstable();
        groups.dedup();
        // Q4_K and Q5_K (32) read in the groups of Q6_K and Q2_K (16) they are stacked with;
        // the Q8_0 output projection alone.
        assert_eq!(groups, [16, 32]);
    }
}
