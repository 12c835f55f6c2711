//! The dense half of a transformer layer on a backend's own memory: what a model drives
//! around the attention that [`crate::RankAttention`] runs.
//!
//! A model's hidden states never leave the backend between layers: activations are fp32
//! matrices in backend memory ([`LayerOps::Tensor`]), weights keep the dtype they were uploaded
//! in ([`LayerOps::Weight`]: f32 on the CPU, bf16/f16/f32 on a GPU, where a GEMM reads its
//! activation rounded to the weight's dtype and accumulates in fp32). Only token ids and
//! positions come from the host, and only logits (and the attention states a cross-rank merge
//! exchanges) go back.
//!
//! Every matrix is row-major. A linear layer's weight is `[out, in]`, as transformers stores
//! it, so `y = x · Wᵀ`. Every op follows transformers' Llama: RMSNorm scales by
//! `1 / sqrt(mean(x²) + eps)` before the weight; RoPE rotates the two halves of each head
//! (`rotate_half`) by angles `position · inv_freq` computed in fp32.

pub use crate::logit_checks::{
    check_logit_places, check_logprob_terms, check_pick_logits, check_softmax_totals,
    check_top_logits, check_walk_tails, TOP_LOGITS_MAX,
};
use crate::merge::MergeOps;
use crate::{EngineError, Result};
use canopy_core::data::{hash_uniform, KV_AMPLITUDE, STREAM_K, STREAM_V};
use canopy_core::logits::TailWalk;
use canopy_core::{AttnShape, CodedSliceMut, DType, TypedSliceMut, TypedVec};
use rayon::prelude::*;

/// Consecutive positions whose keys and values go to consecutive slots of a KV cache
/// ([`LayerOps::fill_kv_random`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FillRun {
    /// The physical slot of the run's first position.
    pub slot: u32,
    /// The run's first position in the sequence.
    pub position: u64,
    /// Positions (and slots) in the run.
    pub tokens: usize,
}

/// Positions a host-side random fill draws and uploads at once: bounded staging memory.
const FILL_ROWS: usize = 8192;

/// `n` values of `stream` from element `first` on, uniform in ±[`KV_AMPLITUDE`].
fn random_values(seed: u64, stream: u32, first: u64, n: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; n];
    out.par_iter_mut().enumerate().for_each(|(i, x)| {
        *x = hash_uniform(seed, stream, first + i as u64, KV_AMPLITUDE);
    });
    out
}

/// What a model asks of a backend, checked once before anything is uploaded
/// ([`LayerOps::check_model`]), so that a configuration is refused with its reason rather
/// than failing half-way through loading.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelNeeds {
    pub shape: AttnShape,
    pub hidden: usize,
    pub intermediate: usize,
    pub vocab: usize,
    pub layers: usize,
    /// The dtype the weights will be uploaded in.
    pub weight_dtype: DType,
    /// Bytes of every weight in `weight_dtype`, once.
    pub weight_bytes: u64,
    /// The KV caches' dtype and tokens per layer (each layer holds one pool of this size).
    pub kv_dtype: DType,
    pub kv_tokens: usize,
    /// The most token rows one forward pass carries (a prefill chunk, or the live samples).
    pub max_rows: usize,
    /// The most query rows one prefill attention carries: a chunk's rows of every rank, which
    /// each rank attends to its own keys before the ranks merge.
    pub attention_rows: usize,
    /// The most cached keys one prefill attention reads (a rank's share of the prompt).
    pub attention_keys: usize,
    /// The most rows whose logits one pass computes (the live samples; a prefill computes
    /// only its last row's).
    pub logit_rows: usize,
    /// Devices of other ranks that this device exchanges with directly (NCCL on GPUs, whose
    /// buffers take device memory): 0 for a device of one rank alone, or of several ranks.
    pub peer_devices: usize,
    /// The ranks this device runs, each with its own passes' activations and logits
    /// (`kv_tokens` already counts all their pools).
    pub ranks_here: usize,
}

impl ModelNeeds {
    /// These needs on a device that holds `here` of the `ranks` ranks: a rank with a device
    /// of its own exchanges with every other rank's.
    pub fn on_device_holding(mut self, here: usize, ranks: usize) -> ModelNeeds {
        self.ranks_here = here;
        self.peer_devices = if here == 1 {
            ranks.saturating_sub(1)
        } else {
            0
        };
        self
    }

    /// Bytes of every layer's KV pool, K and V.
    pub fn kv_bytes(&self) -> u64 {
        (self.kv_tokens * self.shape.kv_token_bytes(self.kv_dtype) * 2 * self.layers) as u64
    }
}

/// A layer's KV cache and the `(row, slot)` pairs of a pass's rows to store into it.
pub type KvStore<'a, B> = (&'a mut <B as crate::Backend>::Kv, &'a [(u32, u32)]);

/// Dense layer operations over a backend's own tensors. Every shape mismatch is an error,
/// never a panic.
pub trait LayerOps: MergeOps {
    /// Activations: a row-major `rows × cols` fp32 matrix in backend memory.
    type Tensor: Send;
    /// A weight: a row-major `rows × cols` matrix in backend memory, in its upload dtype.
    type Weight: Send + Sync;
    /// A decode pass recorded once and replayed as one launch ([`LayerOps::begin_capture`]).
    type Graph: Send;

    /// The dtype weights and KV should be loaded in, when the user does not choose.
    fn preferred_dtype(&self) -> DType;

    /// Refuses, with the reason, a model this backend cannot run: head dims, dtypes, GQA
    /// ratios and memory, all checked here and nowhere else.
    fn check_model(&self, needs: &ModelNeeds) -> Result<()>;

    /// Uploads a `rows × cols` weight, keeping its dtype. Weights uploaded through one
    /// backend serve every backend on the same device (ranks sharing a GPU share them), once
    /// the upload has finished.
    fn upload_weight(&self, data: &TypedVec, rows: usize, cols: usize) -> Result<Self::Weight>;
    /// Uploads a `rows × cols` weight of `dtype` whose elements `fill` writes a part at a
    /// time: `fill(first, part)` writes elements `first..first + part.len()`, row-major. The
    /// parts cover the weight in order, each written before the next is asked for, so a
    /// GPU can have `fill` write into the page-locked memory it copies from, and copy one
    /// part while the next is read: a model's weights then cross the host's memory once.
    /// The copies may still be under way when this returns: this backend's own work is
    /// ordered after them, other backends' after [`LayerOps::finish_uploads`].
    fn upload_weight_with<E: From<EngineError>>(
        &self,
        dtype: DType,
        shape: (usize, usize),
        fill: &mut dyn FnMut(usize, TypedSliceMut) -> Result<(), E>,
    ) -> Result<Self::Weight, E>;
    /// Uploads a `rows × cols` weight given as codes in groups of `group`
    /// ([`canopy_core::coded`]), which `fill` writes a part at a time as
    /// [`LayerOps::upload_weight_with`]'s does, where this backend computes from such a weight
    /// as it is: a quantized model's weights then take a third of f32's memory or less, and
    /// of the bytes a product reads. `None` where it keeps every weight in a dtype, without calling
    /// `fill`: the weight is then uploaded that way instead.
    fn upload_coded_weight<E: From<EngineError>>(
        &self,
        shape: (usize, usize),
        group: usize,
        fill: &mut dyn FnMut(usize, CodedSliceMut) -> Result<(), E>,
    ) -> Option<Result<Self::Weight, E>> {
        let _ = (shape, group, fill);
        None
    }
    /// Waits until the weights uploaded by [`LayerOps::upload_weight_with`] have landed, so
    /// that every backend on the device (ranks sharing a GPU) may read them. Provided: nothing
    /// to wait for.
    fn finish_uploads(&self) -> Result<()> {
        Ok(())
    }
    /// A zeroed `rows × cols` activation.
    fn tensor(&self, rows: usize, cols: usize) -> Result<Self::Tensor>;
    /// A `rows × cols` activation for an op to write in full as its output; what it holds
    /// until then is unspecified, so a GPU need not clear it (a prefill's activations are
    /// hundreds of megabytes a layer). Provided: [`LayerOps::tensor`].
    fn output_tensor(&self, rows: usize, cols: usize) -> Result<Self::Tensor> {
        self.tensor(rows, cols)
    }
    /// A `rows × cols` activation that is read by a product with `weight` (`matmul`,
    /// `matmul_add`, `matmul_swiglu`) and written in full by `rms_norm`, `matmul_swiglu` or
    /// `states_output` (unspecified until then, as [`LayerOps::output_tensor`]'s). A backend
    /// may keep it in the form the product reads instead (a GPU's 16-bit GEMM operand),
    /// written by the op that produces it, rather than converting it in an op of its own
    /// before each product; the product's values are the same either way. Such a tensor is
    /// then read only by products with a weight of `weight`'s dtype: any other read is an
    /// error.
    fn gemm_operand(
        &self,
        rows: usize,
        cols: usize,
        weight: &Self::Weight,
    ) -> Result<Self::Tensor> {
        let _ = weight;
        self.output_tensor(rows, cols)
    }
    fn upload_tensor(&self, data: &[f32], rows: usize, cols: usize) -> Result<Self::Tensor>;
    fn download_tensor(&self, t: &Self::Tensor) -> Result<Vec<f32>>;
    /// `(rows, cols)` of `t`.
    fn dims(&self, t: &Self::Tensor) -> (usize, usize);
    /// Row `rows[i]` of `src` into row `i` of `out` (same columns, `rows.len()` rows): the
    /// rows a pass needs logits of, without the rest.
    fn gather_rows(&self, src: &Self::Tensor, rows: &[usize], out: &mut Self::Tensor)
        -> Result<()>;
    /// Row `rows[i]` of `src`'s states (every head's output and lse) into row `i` of `out`
    /// (same heads and head size, `rows.len()` rows): states put in the order a collective
    /// splits them.
    fn gather_states(
        &self,
        src: &Self::States,
        rows: &[usize],
        out: &mut Self::States,
    ) -> Result<()>;
    /// Rows `first..first + out.rows` of `src` into `out` (same columns).
    fn copy_rows(&self, src: &Self::Tensor, first: usize, out: &mut Self::Tensor) -> Result<()> {
        let (have, n) = (self.dims(src).0, self.dims(out).0);
        if first + n > have {
            return Err(EngineError::Backend {
                backend: self.name(),
                message: format!(
                    "copy_rows: rows {first}..{} of a tensor of {have} rows",
                    first + n
                ),
            });
        }
        let rows: Vec<usize> = (first..first + n).collect();
        self.gather_rows(src, &rows, out)
    }
    /// `t`'s elements, row-major, as a transport buffer: collectives move activations
    /// ([`crate::Transport::all_gather_buf`]) without a copy.
    fn tensor_buf<'t>(&self, t: &'t Self::Tensor) -> &'t Self::Buf;
    /// [`LayerOps::tensor_buf`], to be written.
    fn tensor_buf_mut<'t>(&self, t: &'t mut Self::Tensor) -> &'t mut Self::Buf;

    /// `out[i] = table[ids[i]]`; an id past the table is an error naming it.
    fn embed(&self, table: &Self::Weight, ids: &[u32], out: &mut Self::Tensor) -> Result<()>;
    /// `out = rmsnorm(x) * weight` row by row (`weight` is `1 × cols`).
    fn rms_norm(
        &self,
        x: &Self::Tensor,
        weight: &Self::Weight,
        eps: f32,
        out: &mut Self::Tensor,
    ) -> Result<()>;
    /// `out[rows × n] = x[rows × k] · w[n × k]ᵀ`.
    fn matmul(&self, x: &Self::Tensor, w: &Self::Weight, out: &mut Self::Tensor) -> Result<()>;
    /// `acc[rows × n] += x[rows × k] · w[n × k]ᵀ`: a projection and the residual connection
    /// after it, in one pass over the weight.
    fn matmul_add(&self, x: &Self::Tensor, w: &Self::Weight, acc: &mut Self::Tensor) -> Result<()>;
    /// `out[rows × f] = silu(x · gateᵀ) * (x · upᵀ)`, where `w` (`2f × k`) holds the gate
    /// projection's rows then the up projection's: the SwiGLU MLP's first half, in one pass
    /// over both weights.
    fn matmul_swiglu(
        &self,
        x: &Self::Tensor,
        w: &Self::Weight,
        out: &mut Self::Tensor,
    ) -> Result<()>;
    /// [`LayerOps::rms_norm`] of `x` into `normed`, then [`LayerOps::matmul`] of it into
    /// `out`. A backend may instead normalise the rows as the product reads them, one pass
    /// instead of two, and leave `normed` unwritten: it is scratch.
    fn rms_norm_matmul(
        &self,
        x: &Self::Tensor,
        (norm, eps): (&Self::Weight, f32),
        w: &Self::Weight,
        normed: &mut Self::Tensor,
        out: &mut Self::Tensor,
    ) -> Result<()> {
        self.rms_norm(x, norm, eps, normed)?;
        self.matmul(normed, w, out)
    }
    /// [`LayerOps::rms_norm_matmul`] with [`LayerOps::matmul_swiglu`] as the product.
    fn rms_norm_matmul_swiglu(
        &self,
        x: &Self::Tensor,
        (norm, eps): (&Self::Weight, f32),
        w: &Self::Weight,
        normed: &mut Self::Tensor,
        out: &mut Self::Tensor,
    ) -> Result<()> {
        self.rms_norm(x, norm, eps, normed)?;
        self.matmul_swiglu(normed, w, out)
    }
    /// Splits each row `i` of a fused projection `qkv` (`q | k | v`, as wide as the three
    /// outputs) into `q`, `k` and `v`, rotating every head of `q` and `k` (`2 · half`
    /// columns) by `positions[i]`; `inv_freq` is a `1 × half` f32 weight.
    #[allow(clippy::too_many_arguments)]
    fn rope_split(
        &self,
        qkv: &Self::Tensor,
        positions: &[u32],
        inv_freq: &Self::Weight,
        q: &mut Self::Tensor,
        k: &mut Self::Tensor,
        v: &mut Self::Tensor,
    ) -> Result<()>;

    /// For each `(row, slot)` of `rows`, writes that row of `k` and `v` (`rows × kv_heads ·
    /// head_dim`) into physical token `slot` of `kv`, converted to the KV's dtype. Rows not
    /// named are not stored here: a decode step's new tokens each go to one rank.
    fn store_kv(
        &self,
        kv: &mut Self::Kv,
        k: &Self::Tensor,
        v: &Self::Tensor,
        rows: &[(u32, u32)],
    ) -> Result<()>;
    /// Fills each run's slots of `kv` with random keys and values, those of its positions:
    /// element `e` of position `p`'s K (or V) is `canopy_core::data::hash_uniform(seed, K (or
    /// V)'s stream, p · width + e, KV_AMPLITUDE)`, converted to the KV's dtype. A context for
    /// decode timing without a prefill, the same on every rank count. The default draws the
    /// values on the host and stores them with [`LayerOps::store_kv`]; a GPU draws them where
    /// they are stored.
    fn fill_kv_random(
        &self,
        shape: &AttnShape,
        kv: &mut Self::Kv,
        seed: u64,
        runs: &[FillRun],
    ) -> Result<()> {
        let width = shape.kv_token_elems();
        for run in runs {
            for start in (0..run.tokens).step_by(FILL_ROWS) {
                let rows = FILL_ROWS.min(run.tokens - start);
                let first = (run.position + start as u64) * width as u64;
                let draw = |stream| random_values(seed, stream, first, rows * width);
                let k = self.upload_tensor(&draw(STREAM_K), rows, width)?;
                let v = self.upload_tensor(&draw(STREAM_V), rows, width)?;
                let slots: Vec<(u32, u32)> = (0..rows as u32)
                    .map(|i| (i, run.slot + start as u32 + i))
                    .collect();
                self.store_kv(kv, &k, &v, &slots)?;
            }
        }
        Ok(())
    }
    /// [`LayerOps::rope_split`], then [`LayerOps::store_kv`] of the rotated `k` and `v` for
    /// `rows`: RoPE fused into the KV append where a backend can do both in one pass.
    #[allow(clippy::too_many_arguments)]
    fn rope_split_store(
        &self,
        qkv: &Self::Tensor,
        positions: &[u32],
        inv_freq: &Self::Weight,
        (q, k, v): (&mut Self::Tensor, &mut Self::Tensor, &mut Self::Tensor),
        kv: &mut Self::Kv,
        rows: &[(u32, u32)],
    ) -> Result<()> {
        self.rope_split(qkv, positions, inv_freq, q, k, v)?;
        self.store_kv(kv, k, v, rows)
    }
    /// [`LayerOps::rms_norm_matmul`] of a fused q|k|v weight into `fused`, then
    /// [`LayerOps::rope_split_store`] of it (or [`LayerOps::rope_split`] without `store`): a
    /// layer's rotated queries, keys and values. A backend may rotate and store them in the
    /// product's epilogue, with the same values, and leave `normed` and `fused` unwritten:
    /// they are scratch.
    #[allow(clippy::too_many_arguments)]
    fn rms_norm_matmul_rope(
        &self,
        x: &Self::Tensor,
        norm: (&Self::Weight, f32),
        w: &Self::Weight,
        (normed, fused): (&mut Self::Tensor, &mut Self::Tensor),
        positions: &[u32],
        inv_freq: &Self::Weight,
        qkv: (&mut Self::Tensor, &mut Self::Tensor, &mut Self::Tensor),
        store: Option<KvStore<'_, Self>>,
    ) -> Result<()> {
        self.rms_norm_matmul(x, norm, w, normed, fused)?;
        match store {
            Some((kv, rows)) => self.rope_split_store(fused, positions, inv_freq, qkv, kv, rows),
            None => {
                let (q, k, v) = qkv;
                self.rope_split(fused, positions, inv_freq, q, k, v)
            }
        }
    }
    /// The attention queries held in `q` (`rows × q_heads · head_dim`).
    fn tensor_queries(&self, shape: &AttnShape, q: &Self::Tensor) -> Result<Self::Queries>;

    /// [`LayerOps::tensor_queries`] of a tensor nothing reads after: a backend may keep its
    /// memory as the queries' instead of copying it (one copy fewer a layer of a decode step).
    fn take_queries(&self, shape: &AttnShape, q: Self::Tensor) -> Result<Self::Queries> {
        self.tensor_queries(shape, &q)
    }

    /// `rows` empty states (`o = 0`, `lse = -inf`), for [`LayerOps::causal_attention`] to
    /// merge blocks into.
    fn empty_states(&self, shape: &AttnShape, rows: usize) -> Result<Self::States>;
    /// Attention of the query rows `q` at positions `q_pos` over one block of keys, merged
    /// into `states`: a query sees the keys at or before its own position. Blocks merge
    /// exactly, in any number and order, so a prompt's chunks can arrive one at a time from
    /// other ranks.
    fn causal_attention(
        &self,
        shape: &AttnShape,
        q: &Self::Tensor,
        q_pos: &[u32],
        keys: KeyBlock<'_, Self::Tensor>,
        states: &mut Self::States,
    ) -> Result<()> {
        self.causal_attention_from(shape, q, q_pos, None, keys, states)
    }
    /// [`LayerOps::causal_attention`] where, with `q_from`, row `r` sees only the keys at
    /// positions `q_from[r] ..= q_pos[r]`: one block of a pass's keys serves several prompts'
    /// chunks, each row seeing its own chunk's keys (the pass's rows numbered as positions,
    /// each row's window starting at its chunk's first row).
    fn causal_attention_from(
        &self,
        shape: &AttnShape,
        q: &Self::Tensor,
        q_pos: &[u32],
        q_from: Option<&[u32]>,
        keys: KeyBlock<'_, Self::Tensor>,
        states: &mut Self::States,
    ) -> Result<()>;
    /// The keys and values `kv` holds at physical `slots`, as `slots.len() × kv_heads ·
    /// head_dim` activations (the cache's values, widened).
    fn load_kv(&self, kv: &Self::Kv, slots: &[u32]) -> Result<(Self::Tensor, Self::Tensor)>;
    /// [`LayerOps::causal_attention`] over keys where the cache keeps them: a chunked
    /// prefill's queries read the prompt's earlier chunks, and their own, from the cache.
    fn cached_attention(
        &self,
        shape: &AttnShape,
        q: &Self::Tensor,
        q_pos: &[u32],
        keys: CachedKeys<'_, Self::Kv>,
        states: &mut Self::States,
    ) -> Result<()> {
        keys.check(self.name(), "cached_attention")?;
        let CachedKeys {
            kv,
            slots,
            positions,
        } = keys;
        let (k, v) = self.load_kv(kv, slots)?;
        let keys = KeyBlock {
            k: &k,
            v: &v,
            positions,
            dtype: self.kv_dtype(kv),
        };
        self.causal_attention(shape, q, q_pos, keys, states)
    }
    /// [`LayerOps::cached_attention`] of rows that see no keys but these, its output written
    /// into `out` (`rows × q_heads · head_dim`) as [`LayerOps::states_output`] writes it:
    /// a one-rank prefill's queries over every prompt key they see. A backend may store the
    /// output straight from the attention, with no states between.
    fn cached_attention_output(
        &self,
        shape: &AttnShape,
        q: &Self::Tensor,
        q_pos: &[u32],
        keys: CachedKeys<'_, Self::Kv>,
        out: &mut Self::Tensor,
    ) -> Result<()> {
        attention_output_through_states(self, shape, q, q_pos, keys, out)
    }
    /// The states' outputs `o` (`rows × q_heads · head_dim`) as an activation.
    fn states_output(&self, states: &Self::States, out: &mut Self::Tensor) -> Result<()>;
    /// [`Backend::step`](crate::Backend::step) into `states`, whose last kernel may also write
    /// their outputs into `out` as [`LayerOps::states_output`] does, where `out` is kept in the
    /// form a product reads ([`LayerOps::gemm_operand`]): no op of its own then converts them.
    /// Returns whether `out` was written. By default it is not.
    fn step_output(
        &self,
        kv: &Self::Kv,
        q: &Self::Queries,
        plan: &Self::Plan,
        partials: &mut Self::States,
        states: &mut Self::States,
        out: &mut Self::Tensor,
    ) -> Result<bool> {
        let _ = out;
        self.step(kv, q, plan, partials, states)?;
        Ok(false)
    }
    /// [`MergeOps::merge_into`] of `x` into `acc`, which may also write the merged outputs into
    /// `out` as [`LayerOps::step_output`] does. Returns whether `out` was written.
    fn merge_into_output(
        &self,
        acc: &mut Self::States,
        x: &Self::States,
        out: &mut Self::Tensor,
    ) -> Result<bool> {
        let _ = out;
        self.merge_into(acc, x)?;
        Ok(false)
    }
    /// `acc += o · wᵀ` for the states' outputs `o` ([`LayerOps::states_output`]'s rows): the
    /// attention's output projection and residual. `scratch` (`rows × q_heads · head_dim`,
    /// from [`LayerOps::gemm_operand`] for `w`) holds the outputs where the product cannot
    /// read them in the states; a backend whose product can skips that copy.
    fn states_matmul_add(
        &self,
        states: &Self::States,
        w: &Self::Weight,
        scratch: &mut Self::Tensor,
        acc: &mut Self::Tensor,
    ) -> Result<()> {
        self.states_output(states, scratch)?;
        self.matmul_add(scratch, w, acc)
    }

    /// Each row's `k` most likely tokens of `logits` (`rows × vocab`), most likely first in
    /// [`canopy_core::logits`]' order, into `out` (`rows × 2k`): the row's `k` logits, then
    /// their token ids as `f32` bit patterns ([`f32::from_bits`]). A draw from these equals
    /// the draw from the whole row, and the host reads `2k` numbers a row instead of the
    /// vocabulary. `k` is at most [`TOP_LOGITS_MAX`] and the vocabulary
    /// ([`check_top_logits`]).
    fn top_logits(&self, logits: &Self::Tensor, k: usize, out: &mut Self::Tensor) -> Result<()>;

    /// What the log-probability of token `targets[r]` in each row `r` of `logits` (`rows ×
    /// vocab`) needs, into `out` (`rows × 2`): the row's log-normaliser `ln Σ exp(logit)`, then
    /// the target's logit; its log-probability is their difference. With
    /// [`top_logits`](Self::top_logits) beside it, the host reads a few numbers a row for a
    /// token's log-probability and the likeliest tokens', not the vocabulary
    /// ([`check_logprob_terms`]).
    fn logprob_terms(
        &self,
        logits: &Self::Tensor,
        targets: &[u32],
        out: &mut Self::Tensor,
    ) -> Result<()>;

    /// Each row's softmax total at its temperature: `Σ exp((logit - max) / temperatures[r])`
    /// over row `r` of `logits` (`rows × vocab`), `max` the row's largest logit, into `out`
    /// (`rows × 1`). With [`top_logits`](Self::top_logits) beside it, a draw at a temperature
    /// over the whole vocabulary reads a row's likeliest tokens and this total, and the whole
    /// row only when it lands past them ([`check_softmax_totals`]).
    fn softmax_totals(
        &self,
        logits: &Self::Tensor,
        temperatures: &[f32],
        out: &mut Self::Tensor,
    ) -> Result<()>;

    /// The logits at `picks`, each a `(row, token)` of `logits` (`rows × vocab`), into `out`
    /// (`picks × 1`). A draw that changes some tokens' logits (penalties, biases) reads theirs
    /// beside its row narrowed by [`top_logits`](Self::top_logits), not its whole row
    /// ([`check_pick_logits`]).
    fn pick_logits(
        &self,
        logits: &Self::Tensor,
        picks: &[(u32, u32)],
        out: &mut Self::Tensor,
    ) -> Result<()>;

    /// Where each of `walks` lands, `(row, walk)` (the rest of a draw by the row's softmax total
    /// past its likeliest tokens, [`TailWalk`]), into `out` (`walks × 2`): the token as an
    /// `f32` bit pattern (`u32::MAX`: no token past the head has a probability above 0), then
    /// its logit in the row (the model's, not the walk's `changed` one). A draw that lands past
    /// its narrowed row then reads two numbers, not the row ([`check_walk_tails`]). The CPU
    /// walks as [`TailWalk::land`]; another backend may sum in another order, and land on a
    /// token next to the host's where the target lies within its rounding of their boundary.
    fn walk_tails(
        &self,
        logits: &Self::Tensor,
        walks: &[(usize, &TailWalk)],
        out: &mut Self::Tensor,
    ) -> Result<()>;

    /// Sets the logits at `places`, each a `(row, token)` of `logits`, to `value`
    /// ([`check_logit_places`]). With `-∞` in a copy of some rows, their
    /// [`softmax_totals`](Self::softmax_totals) leave those tokens out: the total of the
    /// tokens a draw does not change, to which it adds the changed ones' terms itself.
    fn set_logits(
        &self,
        logits: &mut Self::Tensor,
        places: &[(u32, u32)],
        value: f32,
    ) -> Result<()>;

    /// The rows a dense product of `rows` activation rows runs at, its activations holding
    /// that many: a backend that sets each new shape up on its first use (a GPU's GEMM
    /// library) pads a product's rows to a few counts, so that a server's steps, whose rows
    /// change with every prompt chunk, meet no new shape once it has warmed them up
    /// (`ModelLayers::warm_up_products`). Provided: `rows`.
    fn product_rows(&self, rows: usize) -> usize {
        rows
    }
    /// Starts (`true`) or stops timing the ways a backend can run each dense product: while
    /// on, a product of a shape not yet timed is run every way the backend's GEMM library
    /// offers, and from then on the fastest way. A server turns it on for its warm-up on one
    /// rank and sends the choices to the others ([`LayerOps::product_choices`]), so that every
    /// rank computes the same bits. Provided: no choices to make.
    fn tune_products(&self, _on: bool) -> Result<()> {
        Ok(())
    }
    /// The choices timed so far ([`LayerOps::tune_products`]), as data for
    /// [`LayerOps::adopt_product_choices`] on another rank's backend. Provided: none.
    fn product_choices(&self) -> Result<Vec<u8>> {
        Ok(Vec::new())
    }
    /// Runs each product the way `choices` (another backend's [`LayerOps::product_choices`])
    /// says, refused where this backend cannot. Provided: accepts no choices.
    fn adopt_product_choices(&self, choices: &[u8]) -> Result<()> {
        match choices.is_empty() {
            true => Ok(()),
            false => Err(EngineError::Config(format!(
                "the {} backend has no product choices to adopt",
                self.name()
            ))),
        }
    }
    /// Whether this backend records passes as graphs (`None`: it does not), and if so the
    /// epoch of the buffers a recorded pass reads beyond its own: KV, plans, states and step
    /// inputs. Making one of them anew moves the epoch, so a recording of an older epoch is
    /// stale and is never replayed.
    fn graph_epoch(&self) -> Option<u64> {
        None
    }
    /// Puts a decode step's token ids, positions and `(row, slot)` stores where the pass's
    /// [`LayerOps::embed`], [`LayerOps::rope_split`] and [`LayerOps::store_kv`] read them,
    /// written in place, so a recorded pass replayed next reads this step's.
    fn stage_step(&self, _ids: &[u32], _positions: &[u32], _stores: &[(u32, u32)]) -> Result<()> {
        Ok(())
    }
    /// Starts recording: the ops that follow are recorded, not run, until
    /// [`LayerOps::end_capture`]. Between the two, only ops on staged inputs and on buffers
    /// made before the recording began may run; anything else is an error that ends it.
    fn begin_capture(&self) -> Result<()> {
        Err(EngineError::Config(format!(
            "the {} backend records no graphs",
            self.name()
        )))
    }
    /// Ends the recording begun by [`LayerOps::begin_capture`] (also after an op in it
    /// failed) and returns it, ready to replay.
    fn end_capture(&self) -> Result<Self::Graph>;
    /// Runs a recorded pass on this step's staged inputs.
    fn replay(&self, graph: &Self::Graph) -> Result<()>;
}

/// A block of keys and values for [`LayerOps::causal_attention`]: `k` and `v` are `tokens ×
/// kv_heads · head_dim` activations at `positions`, read as the KV cache holds them, rounded to
/// `dtype`, so a prompt's attention sees the keys its decode steps will read from the cache (a
/// GPU then runs it on tensor cores).
#[derive(Debug)]
pub struct KeyBlock<'a, T> {
    pub k: &'a T,
    pub v: &'a T,
    pub positions: &'a [u32],
    pub dtype: DType,
}

// References only, so copies whatever `T` is (a derive would ask `T: Copy`).
impl<T> Clone for KeyBlock<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for KeyBlock<'_, T> {}

/// Keys and values where a KV cache keeps them, for [`LayerOps::cached_attention`]: the
/// physical `slots` of `kv`, the keys at `positions` (one per slot).
#[derive(Debug)]
pub struct CachedKeys<'a, K> {
    pub kv: &'a K,
    pub slots: &'a [u32],
    pub positions: &'a [u32],
}

// References only, so copies whatever `K` is.
impl<K> Clone for CachedKeys<'_, K> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<K> Copy for CachedKeys<'_, K> {}

impl<K> CachedKeys<'_, K> {
    /// Refuses keys whose positions are not one per slot, as `expect_size` does.
    pub fn check(&self, backend: &'static str, op: &str) -> Result<()> {
        expect_size(
            backend,
            op,
            "the key positions",
            self.positions.len(),
            self.slots.len(),
        )
    }
}

/// The size of one product `out[rows × cols] = x[rows × inner] · w[cols × inner]ᵀ`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemmShape {
    pub rows: usize,
    pub cols: usize,
    pub inner: usize,
}

impl GemmShape {
    /// Multiply-adds count two FLOPs each.
    pub fn flops(&self) -> f64 {
        2.0 * self.rows as f64 * self.cols as f64 * self.inner as f64
    }
}

/// FLOP/s of `backend`'s [`LayerOps::matmul`] at `shape` with a weight in `dtype`, the median
/// of `iters` runs timed as the backend times steps ([`crate::Backend::time_steps`]): the
/// product a prefill's projections run, its activation rounded to the weight's dtype where
/// the backend does so, with no new kernel. The operands hold hashed values, never zeros (a
/// GPU multiplies zeros faster than data).
pub fn measure_gemm_rate<B: LayerOps>(
    backend: &B,
    shape: GemmShape,
    dtype: DType,
    iters: usize,
) -> Result<f64> {
    use rayon::prelude::*;
    let values = |n: usize, stream: u32| -> Vec<f32> {
        (0..n)
            .into_par_iter()
            .map(|i| canopy_core::data::hash_uniform(0, stream, i as u64, 1.0))
            .collect()
    };
    let GemmShape { rows, cols, inner } = shape;
    let w = backend.upload_weight(
        &TypedVec::from_f32(dtype, &values(cols * inner, 0)),
        cols,
        inner,
    )?;
    let x = backend.upload_tensor(&values(rows * inner, 1), rows, inner)?;
    let mut out = backend.tensor(rows, cols)?;
    let times = backend.time_steps(iters.max(1), crate::Cache::Warm, &mut || {
        backend.matmul(&x, &w, &mut out)
    })?;
    Ok(shape.flops() / (canopy_core::stats::median(&times) * 1e-3))
}

/// [`LayerOps::cached_attention_output`] as `cached_attention` into empty states, then
/// `states_output`: the trait's default, and a backend's way where it has no other.
pub fn attention_output_through_states<B: LayerOps + ?Sized>(
    b: &B,
    shape: &AttnShape,
    q: &B::Tensor,
    q_pos: &[u32],
    keys: CachedKeys<'_, B::Kv>,
    out: &mut B::Tensor,
) -> Result<()> {
    let mut states = b.empty_states(shape, q_pos.len())?;
    b.cached_attention(shape, q, q_pos, keys, &mut states)?;
    b.states_output(&states, out)
}

/// Refuses operands whose sizes disagree: a caller's bug, reported with the op and the
/// operand on `backend`, never a panic. Every backend's ops check their operands with this.
pub fn expect_size(
    backend: &'static str,
    op: &str,
    what: &str,
    got: usize,
    want: usize,
) -> Result<()> {
    if got == want {
        Ok(())
    } else {
        Err(EngineError::Backend {
            backend,
            message: format!("{op}: {what} is {got}, expected {want}"),
        })
    }
}

/// Refuses a gather of `rows` from a tensor of `have` rows into one of `out_rows`, on `backend`.
pub fn expect_gather(
    backend: &'static str,
    rows: &[usize],
    have: usize,
    out_rows: usize,
) -> Result<()> {
    expect_size(
        backend,
        "gather_rows",
        "the output's rows",
        out_rows,
        rows.len(),
    )?;
    match rows.iter().find(|&&r| r >= have) {
        Some(r) => Err(EngineError::Backend {
            backend,
            message: format!("gather_rows: row {r} of a tensor of {have} rows"),
        }),
        None => Ok(()),
    }
}

/// Refuses a states gather ([`LayerOps::gather_states`]) of `rows` from states of
/// `(rows, heads, head size)` `src` into `out`.
pub fn expect_states_gather(
    backend: &'static str,
    rows: &[usize],
    src: (usize, usize, usize),
    out: (usize, usize, usize),
) -> Result<()> {
    expect_size(backend, "gather_states", "the output's heads", out.1, src.1)?;
    expect_size(
        backend,
        "gather_states",
        "the output's head size",
        out.2,
        src.2,
    )?;
    expect_gather(backend, rows, src.0, out.0)
}

/// Refuses a buffer of `len` values where an op reads or writes `need`.
pub fn expect_room(backend: &'static str, op: &str, len: usize, need: usize) -> Result<()> {
    if need <= len {
        Ok(())
    } else {
        Err(EngineError::Backend {
            backend,
            message: format!("{op}: a buffer of {len} values where {need} are needed"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CpuBackend;

    #[test]
    fn random_values_are_spread_and_depend_on_position_only() {
        use canopy_core::data::STREAM_K;
        let a = random_values(7, STREAM_K, 100, 5000);
        assert!(a.iter().all(|x| (-1.0..1.0).contains(x)));
        let mean = a.iter().sum::<f32>() / a.len() as f32;
        assert!(mean.abs() < 0.05, "mean {mean}");
        // The same positions drawn from another starting point give the same values.
        assert_eq!(random_values(7, STREAM_K, 1100, 10), a[1000..1010]);
        assert_ne!(random_values(8, STREAM_K, 100, 10), a[..10]);
    }

    #[test]
    fn a_gemm_counts_two_flops_per_multiply_add_and_is_timed() {
        let shape = GemmShape {
            rows: 8,
            cols: 48,
            inner: 32,
        };
        assert_eq!(shape.flops(), 2.0 * 8.0 * 48.0 * 32.0);
        let rate = measure_gemm_rate(&CpuBackend, shape, DType::Bf16, 2).unwrap();
        assert!(rate.is_finite() && rate > 0.0, "{rate}");
    }
}
