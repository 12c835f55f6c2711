//! A Llama model's weights, in Hugging Face layout whatever file they came from, read tensor
//! by tensor as a backend asks for them.
//!
//! Both readers (safetensors, GGUF) answer the same two questions — a tensor's shape, and its
//! data converted to the compute dtype — so checking every shape against the configuration
//! happens once, here, when the model is opened. Nothing is read then: [`Weights`] keeps the
//! open, mapped file and reads one tensor at a time. A tensor stored in the compute dtype is
//! read from the file in pieces on every core ([`TensorFile::read_span`]); others are converted or
//! dequantized from the mapping. The host therefore never holds a whole model (an 8B model is
//! 16 GB in bf16), and each device, each rank and every process of a node reads the same pages
//! of the page cache.

use std::io::IsTerminal;
use std::path::Path;
use std::sync::Arc;

use canopy_core::{cut_at_multiples, CodedSliceMut, DType, TypedSliceMut, TypedVec};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::config::LlamaConfig;
use crate::error::{ModelError, Result};
use crate::quant::{self, GgmlType};

/// One tensor in host memory: row-major, outermost dimension first. A linear layer's weight
/// is `[out_features, in_features]`, as transformers stores it.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    pub shape: Vec<usize>,
    pub data: TypedVec,
}

impl HostTensor {
    pub fn len(&self) -> usize {
        self.data.len()
    }

    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    pub fn dtype(&self) -> DType {
        self.data.dtype()
    }
}

/// One tensor of a decoder layer, in the order the layer uses them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LayerPart {
    /// RMSNorm weight before attention, `[hidden]`.
    InputNorm,
    /// `[heads * head_dim, hidden]`.
    Q,
    /// `[kv_heads * head_dim, hidden]`.
    K,
    /// `[kv_heads * head_dim, hidden]`.
    V,
    /// `[hidden, heads * head_dim]`.
    O,
    /// RMSNorm weight before the MLP, `[hidden]`.
    PostNorm,
    /// `[intermediate, hidden]`.
    Gate,
    /// `[intermediate, hidden]`.
    Up,
    /// `[hidden, intermediate]`.
    Down,
}

impl LayerPart {
    pub const ALL: [LayerPart; 9] = [
        LayerPart::InputNorm,
        LayerPart::Q,
        LayerPart::K,
        LayerPart::V,
        LayerPart::O,
        LayerPart::PostNorm,
        LayerPart::Gate,
        LayerPart::Up,
        LayerPart::Down,
    ];
}

/// One of a Llama model's weights, whatever a file format calls it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WeightId {
    /// `[vocab, hidden]`.
    Embed,
    Layer(usize, LayerPart),
    /// Final RMSNorm weight, `[hidden]`.
    FinalNorm,
    /// `[vocab, hidden]`; absent when the output projection is tied to the embedding.
    LmHead,
}

impl WeightId {
    /// Every weight of `config`'s model: the embedding, the layers', the final norm and,
    /// unless tied, the output projection.
    pub fn all(config: &LlamaConfig) -> Vec<WeightId> {
        let mut ids = vec![WeightId::Embed];
        ids.extend(
            (0..config.num_hidden_layers)
                .flat_map(|l| LayerPart::ALL.map(|p| WeightId::Layer(l, p))),
        );
        ids.push(WeightId::FinalNorm);
        if !config.tie_word_embeddings {
            ids.push(WeightId::LmHead);
        }
        ids
    }

    /// The name errors use.
    pub fn name(self) -> String {
        let part = |p| match p {
            LayerPart::InputNorm => "input norm",
            LayerPart::Q => "q_proj",
            LayerPart::K => "k_proj",
            LayerPart::V => "v_proj",
            LayerPart::O => "o_proj",
            LayerPart::PostNorm => "post-attention norm",
            LayerPart::Gate => "gate_proj",
            LayerPart::Up => "up_proj",
            LayerPart::Down => "down_proj",
        };
        match self {
            WeightId::Embed => "embed_tokens".into(),
            WeightId::Layer(l, p) => format!("layer {l} {}", part(p)),
            WeightId::FinalNorm => "norm".into(),
            WeightId::LmHead => "lm_head".into(),
        }
    }

    /// A number of its own, whatever the model's depth.
    pub fn ordinal(self) -> u64 {
        match self {
            WeightId::Embed => 0,
            WeightId::FinalNorm => 1,
            WeightId::LmHead => 2,
            WeightId::Layer(l, p) => 3 + (l * LayerPart::ALL.len() + p as usize) as u64,
        }
    }

    /// An RMSNorm weight (a vector), not a matrix.
    pub fn is_norm(self) -> bool {
        matches!(
            self,
            WeightId::FinalNorm | WeightId::Layer(_, LayerPart::InputNorm | LayerPart::PostNorm)
        )
    }

    /// `(rows, cols)` as `c` implies (a vector is `1 × len`).
    pub fn matrix_shape(self, c: &LlamaConfig) -> (usize, usize) {
        let (h, f) = (c.hidden_size, c.intermediate_size);
        let (qn, kvn) = (
            c.num_attention_heads * c.head_dim,
            c.num_key_value_heads * c.head_dim,
        );
        match self {
            WeightId::Embed | WeightId::LmHead => (c.vocab_size, h),
            WeightId::FinalNorm => (1, h),
            WeightId::Layer(_, p) => match p {
                LayerPart::InputNorm | LayerPart::PostNorm => (1, h),
                LayerPart::Q => (qn, h),
                LayerPart::K | LayerPart::V => (kvn, h),
                LayerPart::O => (h, qn),
                LayerPart::Gate | LayerPart::Up => (f, h),
                LayerPart::Down => (h, f),
            },
        }
    }

    /// The shape a file stores it in, as `c` implies: norms are vectors.
    fn file_shape(self, c: &LlamaConfig) -> Vec<usize> {
        match self.matrix_shape(c) {
            (rows, cols) if self.is_norm() => vec![rows * cols],
            (rows, cols) => vec![rows, cols],
        }
    }
}

/// Where a model's weights come from when a backend uploads them: a model on disk
/// ([`Weights`]), or values drawn for timing a shape without its weights.
pub trait WeightSource: Send + Sync {
    /// Whether the model has an output projection of its own, rather than the embedding's.
    fn has_lm_head(&self) -> bool;
    /// The dtype every weight is read as.
    fn dtype(&self) -> DType;
    /// Writes elements `first..first + out.len()` of weight `id`, row-major in its
    /// [`WeightId::matrix_shape`] and in [`WeightSource::dtype`], into `out`. An upload reads
    /// each weight a part at a time, straight into the memory the device copies from, and
    /// stacks the weights that share an input into one; a part may start and end anywhere.
    /// Called from any thread.
    fn read_part(&self, id: WeightId, first: usize, out: TypedSliceMut) -> Result<()>;
    /// The group size in which weight `id` can be read as codes
    /// ([`WeightSource::read_codes`]) whose values equal, bit for bit, what
    /// [`WeightSource::read_part`] gives in [`WeightSource::dtype`]: a quantized weight read in
    /// f32. `None` by default, and for every other weight.
    fn code_group(&self, id: WeightId) -> Option<usize> {
        let _ = id;
        None
    }
    /// Writes elements `first..first + out.len()` of weight `id` as codes in groups of
    /// `out.group`, a divisor of [`WeightSource::code_group`] that the part's ends are
    /// multiples of. An error for a weight with no code group.
    fn read_codes(&self, id: WeightId, first: usize, out: CodedSliceMut) -> Result<()> {
        let _ = (first, out);
        Err(ModelError::BufferMismatch {
            tensor: id.name(),
            needed: "elements in a dtype".into(),
            given: "codes".into(),
        })
    }
    /// A hint that weight `id` is read soon: a file starts coming in from the disk while the
    /// weights before it are read, so a cold read waits on the disk's rate rather than on one
    /// page fault at a time. Does nothing by default.
    fn prefetch(&self, id: WeightId) {
        let _ = id;
    }
}

/// A file (or set of shards) that tensors can be read from by name.
pub(crate) trait TensorSource: Send + Sync {
    /// The file named in errors about missing tensors.
    fn path(&self) -> &Path;
    /// The row-major shape of tensor `name`, `None` if the source has no such tensor.
    fn shape(&self, name: &str) -> Option<Vec<usize>>;
    /// Tensor `name`'s stored type and bytes, checked to lie inside the file; an error for a
    /// type canopy does not convert.
    fn stored(&self, name: &str) -> Result<(GgmlType, &[u8])>;
    /// The file tensor `name`'s stored bytes lie in, `None` if the source has no such tensor.
    fn file_of(&self, name: &str) -> Option<TensorFile<'_>>;
}

/// An open model file: its mapping, which [`TensorSource::stored`]'s bytes are a part of, and
/// its path, for errors.
pub(crate) struct TensorFile<'a> {
    pub file: &'a std::fs::File,
    pub map: &'a memmap2::Mmap,
    pub path: &'a Path,
}

/// Bytes a thread reads from a file at once in [`TensorFile::read_span`]: an upload's part
/// (tens of megabytes) is then read by every core, with as many requests in flight.
const READ_PIECE_BYTES: usize = 1 << 20;

impl TensorFile<'_> {
    /// Where `bytes`, a part of the mapping, start in the file.
    fn offset_of(&self, bytes: &[u8]) -> usize {
        bytes.as_ptr() as usize - self.map.as_ptr() as usize
    }

    /// Copies `bytes`, a part of the mapping, into `out` by reads of the file in pieces on
    /// every core. From a cold page cache each piece is a request of its own, so the disk has
    /// many in flight; from a warm one the kernel copies, where reading through the mapping
    /// takes a page fault per 4 KB page.
    fn read_span(&self, bytes: &[u8], out: &mut [u8]) -> Result<()> {
        debug_assert_eq!(bytes.len(), out.len());
        #[cfg(unix)]
        {
            use rayon::prelude::*;
            use std::os::unix::fs::FileExt;
            let offset = self.offset_of(bytes) as u64;
            out.par_chunks_mut(READ_PIECE_BYTES)
                .enumerate()
                .try_for_each(|(i, piece)| {
                    self.file
                        .read_exact_at(piece, offset + (i * READ_PIECE_BYTES) as u64)
                })
                .map_err(|e| ModelError::io(self.path, e))
        }
        #[cfg(not(unix))]
        {
            out.copy_from_slice(bytes);
            Ok(())
        }
    }

    /// Elements `first..first + out.len()` of the tensor stored in `bytes` (a part of the
    /// mapping, whole blocks of `stored`, a type canopy reads), decoded into `out`'s dtype.
    /// The blocks are read from the file in pieces on every core, each piece decoded by the
    /// thread that read it from a buffer of its own, so a warm read takes no page faults, as
    /// [`TensorFile::read_span`]'s does not. A thread keeps its buffer between pieces; one
    /// that takes up another piece while it decodes (rayon's work stealing) reads that one
    /// into a buffer of its own.
    fn read_decoded(
        &self,
        stored: GgmlType,
        bytes: &[u8],
        first: usize,
        out: TypedSliceMut,
        unsupported: &(dyn Fn() -> ModelError + Sync),
    ) -> Result<()> {
        #[cfg(unix)]
        {
            use rayon::prelude::*;
            use std::cell::Cell;
            use std::os::unix::fs::FileExt;
            thread_local! {
                static PIECE: Cell<Vec<u8>> = const { Cell::new(Vec::new()) };
            }
            let (block_elems, block_bytes) = stored.block_layout().ok_or_else(unsupported)?;
            let (block_elems, block_bytes) = (block_elems as usize, block_bytes as usize);
            // One of the decoder's parallel tasks a piece: the thread that reads it decodes
            // it, and a part (tens of megabytes of output) has hundreds to spread.
            let piece_elems = (quant::TASK_ELEMENTS / block_elems).max(1) * block_elems;
            let offset = self.offset_of(bytes) as u64;
            let pieces = cut_at_multiples(out, first, piece_elems);
            pieces.into_par_iter().try_for_each(|(at, piece)| {
                let first_block = at / block_elems;
                let blocks = (at + piece.len()).div_ceil(block_elems) - first_block;
                let mut raw = PIECE.take();
                raw.resize(blocks * block_bytes, 0);
                let from = offset + (first_block * block_bytes) as u64;
                let decoded = match self.file.read_exact_at(&mut raw, from) {
                    Ok(()) => {
                        quant::dequantize_part(stored, &raw, at - first_block * block_elems, piece)
                            .ok_or_else(unsupported)
                    }
                    Err(e) => Err(ModelError::io(self.path, e)),
                };
                PIECE.set(raw);
                decoded
            })
        }
        #[cfg(not(unix))]
        {
            quant::dequantize_part(stored, bytes, first, out).ok_or_else(unsupported)
        }
    }

    /// Asks the kernel to read `bytes`, a part of the mapping, from the disk now, without
    /// waiting for it (`madvise(MADV_WILLNEED)`). A hint: where it fails, page faults read the
    /// bytes as they are touched.
    fn will_need(&self, bytes: &[u8]) {
        #[cfg(unix)]
        {
            let advice = memmap2::Advice::WillNeed;
            let _ = self
                .map
                .advise_range(advice, self.offset_of(bytes), bytes.len());
        }
        #[cfg(not(unix))]
        let _ = bytes;
    }
}

/// How a format names tensors, and whether its Q and K rows are in llama.cpp's order.
pub(crate) struct Layout {
    pub name: fn(WeightId) -> String,
    pub qk_rows_permuted: bool,
}

/// A model file's weights, every shape checked against the configuration, each tensor read
/// in the compute dtype when asked for. Clones share the mapped file.
#[derive(Clone)]
pub struct Weights {
    source: Arc<dyn TensorSource>,
    layout: &'static Layout,
    config: LlamaConfig,
    dtype: DType,
}

impl std::fmt::Debug for Weights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Weights")
            .field("path", &self.source.path())
            .field("dtype", &self.dtype)
            .finish_non_exhaustive()
    }
}

impl Weights {
    /// Checks every tensor `config` needs against `source`'s shapes; reads nothing.
    pub(crate) fn open(
        source: Arc<dyn TensorSource>,
        layout: &'static Layout,
        config: &LlamaConfig,
        dtype: DType,
    ) -> Result<Weights> {
        // A tied checkpoint may still store a copy of the embedding as lm_head; it is not read.
        for id in WeightId::all(config) {
            let name = (layout.name)(id);
            let found = source
                .shape(&name)
                .ok_or_else(|| ModelError::MissingTensor {
                    path: source.path().to_path_buf(),
                    tensor: name.clone(),
                })?;
            let expected = id.file_shape(config);
            if found != expected {
                return Err(ModelError::ShapeMismatch {
                    tensor: name,
                    expected,
                    found,
                });
            }
            source.stored(&name)?;
        }
        Ok(Weights {
            source,
            layout,
            config: config.clone(),
            dtype,
        })
    }

    /// Whether the model has an output projection of its own, rather than the embedding's.
    pub fn has_lm_head(&self) -> bool {
        !self.config.tie_word_embeddings
    }

    /// Bytes the weights take in their compute dtype.
    pub fn size_bytes(&self) -> usize {
        WeightId::all(&self.config)
            .into_iter()
            .map(|id| {
                let (rows, cols) = id.matrix_shape(&self.config);
                rows * cols * self.dtype.size_bytes()
            })
            .sum()
    }

    /// The heads of a weight whose rows llama.cpp permutes within each head (Q and K); 0 for
    /// the others.
    fn permuted_heads(&self, id: WeightId) -> usize {
        match id {
            WeightId::Layer(_, LayerPart::Q) => self.config.num_attention_heads,
            WeightId::Layer(_, LayerPart::K) => self.config.num_key_value_heads,
            _ => 0,
        }
    }

    /// Weight `id` with its shape as the file stores it (norms are vectors), in HF layout.
    pub fn tensor(&self, id: WeightId) -> Result<HostTensor> {
        let (rows, cols) = id.matrix_shape(&self.config);
        let mut data = TypedVec::zeros(self.dtype, rows * cols);
        self.read_part(id, 0, data.slice_mut(0..rows * cols))?;
        Ok(HostTensor {
            shape: id.file_shape(&self.config),
            data,
        })
    }
}

impl WeightSource for Weights {
    fn has_lm_head(&self) -> bool {
        Weights::has_lm_head(self)
    }

    fn dtype(&self) -> DType {
        self.dtype
    }

    fn prefetch(&self, id: WeightId) {
        let name = (self.layout.name)(id);
        if let (Ok((_, bytes)), Some(file)) =
            (self.source.stored(&name), self.source.file_of(&name))
        {
            file.will_need(bytes);
        }
    }

    fn code_group(&self, id: WeightId) -> Option<usize> {
        let tied_head = id == WeightId::LmHead && self.config.tie_word_embeddings;
        if self.dtype != DType::F32 || tied_head {
            return None;
        }
        let (stored, _) = self.source.stored(&(self.layout.name)(id)).ok()?;
        quant::code_group(stored)
    }

    fn read_codes(&self, id: WeightId, first: usize, out: CodedSliceMut) -> Result<()> {
        let name = (self.layout.name)(id);
        let (stored, bytes) = self.source.stored(&name)?;
        let (rows, cols) = id.matrix_shape(&self.config);
        let fits = first
            .checked_add(out.len())
            .is_some_and(|end| end <= rows * cols);
        if self.code_group(id).is_none() || !fits {
            return Err(ModelError::BufferMismatch {
                tensor: name,
                needed: format!(
                    "at most {} elements of a quantized type, from element {first}",
                    rows * cols
                ),
                given: format!("{} coded elements of {}", out.len(), stored.name()),
            });
        }
        let heads = self.permuted_heads(id);
        let read = if self.layout.qk_rows_permuted && heads > 0 {
            let order = stored_row_of_hf_row(rows, heads);
            let row_bytes = bytes.len() / rows;
            cut_at_multiples(out, first, cols)
                .into_iter()
                .try_for_each(|(at, piece)| {
                    let stored_row = order[at / cols];
                    let row = &bytes[stored_row * row_bytes..(stored_row + 1) * row_bytes];
                    quant::codes_part(stored, row, at % cols, piece)
                })
        } else {
            quant::codes_part(stored, bytes, first, out)
        };
        read.ok_or_else(|| ModelError::UnsupportedQuantization {
            ggml_type: stored.name(),
            tensor: name,
        })
    }

    fn read_part(&self, id: WeightId, first: usize, mut out: TypedSliceMut) -> Result<()> {
        let name = (self.layout.name)(id);
        if id == WeightId::LmHead && self.config.tie_word_embeddings {
            return Err(ModelError::MissingTensor {
                path: self.source.path().to_path_buf(),
                tensor: name,
            });
        }
        let (stored, bytes) = self.source.stored(&name)?;
        let (rows, cols) = id.matrix_shape(&self.config);
        check_part(id, rows * cols, first, self.dtype, &out)?;
        let unsupported = || ModelError::UnsupportedQuantization {
            ggml_type: stored.name(),
            tensor: name.clone(),
        };
        let heads = self.permuted_heads(id);
        match self.source.file_of(&name) {
            _ if self.layout.qk_rows_permuted && heads > 0 => {
                read_rows_unpermuted(stored, bytes, (rows, cols), heads, first, out)
                    .ok_or_else(unsupported)?;
            }
            Some(file) if quant::copies_bit_for_bit(stored, self.dtype) => {
                let width = self.dtype.size_bytes();
                let span = &bytes[first * width..(first + out.len()) * width];
                file.read_span(span, out.as_bytes_mut())?;
            }
            Some(file) => file.read_decoded(stored, bytes, first, out, &unsupported)?,
            None => {
                quant::dequantize_part(stored, bytes, first, out).ok_or_else(unsupported)?;
            }
        }
        Ok(())
    }
}

/// Elements `first..first + out.len()` of a Q or K weight of `heads` heads in HF row order,
/// from `bytes`, its rows as llama.cpp stores them (whole blocks of `stored_type` each). The rows
/// are decoded in parallel, each from its stored row straight into its place in `out`.
fn read_rows_unpermuted(
    stored_type: GgmlType,
    bytes: &[u8],
    (rows, cols): (usize, usize),
    heads: usize,
    first: usize,
    out: TypedSliceMut,
) -> Option<()> {
    use rayon::prelude::*;
    if out.is_empty() {
        return Some(());
    }
    let order = stored_row_of_hf_row(rows, heads);
    let row_bytes = bytes.len() / rows;
    let pieces = cut_at_multiples(out, first, cols);
    pieces.into_par_iter().try_for_each(|(at, piece)| {
        let stored = order[at / cols];
        let stored_row = &bytes[stored * row_bytes..(stored + 1) * row_bytes];
        quant::dequantize_part(stored_type, stored_row, at % cols, piece)
    })
}

/// Refuses a part that is not of `dtype`, or that ends past weight `id`'s `len` elements:
/// what [`WeightSource::read_part`] may be given.
pub fn check_part(
    id: WeightId,
    len: usize,
    first: usize,
    dtype: DType,
    out: &TypedSliceMut,
) -> Result<()> {
    if out.dtype() == dtype && first.checked_add(out.len()).is_some_and(|end| end <= len) {
        return Ok(());
    }
    Err(ModelError::BufferMismatch {
        tensor: id.name(),
        needed: format!("at most {len} elements of {dtype}, from element {first}"),
        given: format!("{} elements of {}", out.len(), out.dtype()),
    })
}

/// A progress bar on stderr of `len` steps labelled `prefix` (hidden when stderr is not a
/// terminal): loading and uploading weights.
pub fn progress_bar(len: u64, prefix: String) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr());
    if let Ok(style) = ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} {wide_msg}") {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_prefix(prefix);
    bar
}

/// Where llama.cpp's conversion puts each HF row of a Q or K matrix.
///
/// llama.cpp's `permute(w, n_head)` reshapes the rows to `[n_head, 2, head_dim / 2]` and swaps
/// the last two axes, so that each rotary pair `(j, j + head_dim/2)` of transformers' "rotate
/// half" RoPE becomes two adjacent rows `(2j, 2j + 1)` for its interleaved RoPE. Entry `r` of
/// the result is the stored row that holds HF row `r`.
fn stored_row_of_hf_row(rows: usize, n_head: usize) -> Vec<usize> {
    let head_dim = rows / n_head;
    let half = head_dim / 2;
    (0..rows)
        .map(|r| {
            let (head, within) = (r / head_dim, r % head_dim);
            let (which_half, j) = (within / half, within % half);
            head * head_dim + 2 * j + which_half
        })
        .collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// llama.cpp's `permute`, written from its description: rows reshaped to
    /// `[n_head, 2, head_dim / 2]`, axes 1 and 2 swapped.
    pub(crate) fn llama_cpp_permute(rows: &[Vec<f32>], n_head: usize) -> Vec<Vec<f32>> {
        let head_dim = rows.len() / n_head;
        let half = head_dim / 2;
        let mut out = Vec::with_capacity(rows.len());
        for head in 0..n_head {
            for j in 0..half {
                for which_half in 0..2 {
                    out.push(rows[head * head_dim + which_half * half + j].clone());
                }
            }
        }
        out
    }

    /// Reading a permuted matrix's rows back, whole or in parts that start and end inside
    /// rows, gives transformers' order.
    #[test]
    fn unpermuted_reads_invert_llama_cpp_permute() {
        for (n_head, head_dim, cols) in [(1, 2, 2), (3, 4, 3), (2, 8, 5), (9, 64, 2)] {
            let rows: Vec<Vec<f32>> = (0..n_head * head_dim)
                .map(|r| (0..cols).map(|c| (r * cols + c) as f32).collect())
                .collect();
            let stored: Vec<u8> = llama_cpp_permute(&rows, n_head)
                .iter()
                .flatten()
                .flat_map(|x| x.to_le_bytes())
                .collect();
            let hf: Vec<f32> = rows.iter().flatten().copied().collect();
            let shape = (rows.len(), cols);
            for (first, n) in [(0, hf.len()), (1, hf.len() - 2), (cols - 1, cols), (3, 0)] {
                let mut out = TypedVec::zeros(DType::F32, n);
                let part = out.slice_mut(0..n);
                read_rows_unpermuted(GgmlType::F32, &stored, shape, n_head, first, part).unwrap();
                assert_eq!(
                    out.to_f32_vec(),
                    hf[first..first + n],
                    "{n_head} heads of {head_dim}, {n} from {first}"
                );
            }
        }
    }

    #[test]
    fn permutation_interleaves_halves_of_each_head() {
        // One head of 8 rows: HF rows 0..4 are the first halves of pairs, 4..8 the second.
        // llama.cpp stores them as 0,4,1,5,2,6,3,7; two heads repeat this with an offset.
        let rows: Vec<Vec<f32>> = (0..16).map(|r| vec![r as f32]).collect();
        let stored: Vec<f32> = llama_cpp_permute(&rows, 2).into_iter().flatten().collect();
        assert_eq!(
            stored,
            [0., 4., 1., 5., 2., 6., 3., 7., 8., 12., 9., 13., 10., 14., 11., 15.]
        );
        assert_eq!(stored_row_of_hf_row(8, 1), [0, 2, 4, 6, 1, 3, 5, 7]);
    }

    /// Blocks read from the file in pieces and decoded there give what decoding the mapping
    /// gives: parts across pieces, inside blocks, and tensors that start off any alignment,
    /// for a quantized type and an unquantized one converted. More threads than this host's
    /// cores make them take up pieces while they decode others.
    #[test]
    fn decoded_reads_equal_the_mappings_decoding() {
        let threads = rayon::ThreadPoolBuilder::new()
            .num_threads(16)
            .build()
            .unwrap();
        threads.install(decoded_reads_equal_decoding_of_the_mapping);
    }

    /// A temporary file holding `data`, and its mapping.
    fn mapped(data: &[u8]) -> (std::fs::File, memmap2::Mmap) {
        use std::io::Write;
        let mut file = tempfile::tempfile().unwrap();
        file.write_all(data).unwrap();
        // SAFETY: a private temporary file, not written while mapped.
        let map = unsafe { memmap2::Mmap::map(&file) }.unwrap();
        (file, map)
    }

    fn decoded_reads_equal_decoding_of_the_mapping() {
        for (stored, block_bytes) in [(GgmlType::Q8_0, 34), (GgmlType::F32, 4)] {
            let blocks = 16 * READ_PIECE_BYTES / block_bytes + 5;
            // Small bytes keep every f16 scale and f32 finite.
            let data: Vec<u8> = (0..blocks * block_bytes + 100)
                .map(|i| (i * 37 % 61) as u8 & 0x3b)
                .collect();
            let (file, map) = mapped(&data);
            let tensors = TensorFile {
                file: &file,
                map: &map,
                path: Path::new("test"),
            };
            let bytes = &map[7..7 + blocks * block_bytes];
            let len = blocks * stored.block_layout().unwrap().0 as usize;
            let block_elems = len / blocks;
            let piece = quant::TASK_ELEMENTS / block_elems * block_elems;
            for (first, n) in [
                (0, len),
                (3, len - 9),
                (piece - 5, 10),
                (2 * piece, 1),
                (9, 0),
            ] {
                let mut want = TypedVec::zeros(DType::Bf16, n);
                quant::dequantize_part(stored, bytes, first, want.slice_mut(0..n)).unwrap();
                let mut got = TypedVec::zeros(DType::Bf16, n);
                let unsupported = || unreachable!("both types are read");
                tensors
                    .read_decoded(stored, bytes, first, got.slice_mut(0..n), &unsupported)
                    .unwrap();
                assert_eq!(got, want, "{} from {first}", stored.name());
            }
        }
    }

    /// A span read from the file in pieces equals the mapping's bytes: a span that starts
    /// off any alignment and ends inside its third piece, and an empty one.
    #[test]
    fn spans_read_from_the_file_equal_the_mapping() {
        let len = 2 * READ_PIECE_BYTES + 12_345;
        let data: Vec<u8> = (0..len + 100).map(|i| (i * 7 + i / 251) as u8).collect();
        let (file, map) = mapped(&data);
        let tensors = TensorFile {
            file: &file,
            map: &map,
            path: Path::new("test"),
        };
        for (start, n) in [(37, len), (0, 0), (5, 3)] {
            let bytes = &map[start..start + n];
            let mut out = vec![0u8; n];
            tensors.read_span(bytes, &mut out).unwrap();
            assert_eq!(out, bytes, "{n} bytes from {start}");
        }
    }
}
