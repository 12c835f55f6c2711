//! A Llama model's weights in host memory, in Hugging Face layout whatever file they came from.
//!
//! Both readers (safetensors, GGUF) answer the same two questions — a tensor's shape, and its
//! data converted to the compute dtype — so assembling the model, checking every shape
//! against the configuration and reporting progress happen once, here.

use std::io::IsTerminal;
use std::path::Path;

use canopy_core::{DType, TypedVec};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::config::LlamaConfig;
use crate::error::{ModelError, Result};

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

/// The weights of one decoder layer.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerWeights {
    /// RMSNorm weight before attention, `[hidden]`.
    pub input_norm: HostTensor,
    /// `[heads * head_dim, hidden]`.
    pub q_proj: HostTensor,
    /// `[kv_heads * head_dim, hidden]`.
    pub k_proj: HostTensor,
    /// `[kv_heads * head_dim, hidden]`.
    pub v_proj: HostTensor,
    /// `[hidden, heads * head_dim]`.
    pub o_proj: HostTensor,
    /// RMSNorm weight before the MLP, `[hidden]`.
    pub post_attention_norm: HostTensor,
    /// `[intermediate, hidden]`.
    pub gate_proj: HostTensor,
    /// `[intermediate, hidden]`.
    pub up_proj: HostTensor,
    /// `[hidden, intermediate]`.
    pub down_proj: HostTensor,
}

/// All of a Llama model's weights.
#[derive(Debug, Clone, PartialEq)]
pub struct Weights {
    /// `[vocab, hidden]`.
    pub embed_tokens: HostTensor,
    pub layers: Vec<LayerWeights>,
    /// Final RMSNorm weight, `[hidden]`.
    pub norm: HostTensor,
    /// `[vocab, hidden]`; `None` when the output projection is tied to `embed_tokens`.
    pub lm_head: Option<HostTensor>,
}

impl Weights {
    /// The output projection: `lm_head`, or the embedding matrix when they are tied.
    pub fn output_projection(&self) -> &HostTensor {
        self.lm_head.as_ref().unwrap_or(&self.embed_tokens)
    }

    /// Bytes of host memory the weights occupy.
    pub fn size_bytes(&self) -> usize {
        let layer_bytes: usize = self
            .layers
            .iter()
            .flat_map(|l| {
                [
                    &l.input_norm,
                    &l.q_proj,
                    &l.k_proj,
                    &l.v_proj,
                    &l.o_proj,
                    &l.post_attention_norm,
                    &l.gate_proj,
                    &l.up_proj,
                    &l.down_proj,
                ]
            })
            .map(|t| t.data.as_bytes().len())
            .sum();
        layer_bytes
            + self.embed_tokens.data.as_bytes().len()
            + self.norm.data.as_bytes().len()
            + self.lm_head.as_ref().map_or(0, |t| t.data.as_bytes().len())
    }
}

/// A file (or set of shards) that tensors can be read from by name.
pub(crate) trait TensorSource {
    /// The file named in errors about missing tensors.
    fn path(&self) -> &Path;
    /// The row-major shape of tensor `name`, `None` if the source has no such tensor.
    fn shape(&self, name: &str) -> Option<Vec<usize>>;
    /// Tensor `name`, converted to `dtype`.
    fn read(&self, name: &str, dtype: DType) -> Result<HostTensor>;
}

/// What a tensor is, independent of how a file format names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    Embed,
    InputNorm,
    Q,
    K,
    V,
    O,
    PostAttentionNorm,
    Gate,
    Up,
    Down,
    FinalNorm,
    LmHead,
}

/// How a format names tensors, and whether its Q and K rows are in llama.cpp's order.
pub(crate) struct Layout {
    pub name: fn(Role, usize) -> String,
    pub qk_rows_permuted: bool,
}

impl Role {
    /// The HF-layout shape the configuration implies.
    fn expected_shape(self, c: &LlamaConfig) -> Vec<usize> {
        let q_width = c.num_attention_heads * c.head_dim;
        let kv_width = c.num_key_value_heads * c.head_dim;
        match self {
            Role::Embed | Role::LmHead => vec![c.vocab_size, c.hidden_size],
            Role::InputNorm | Role::PostAttentionNorm | Role::FinalNorm => vec![c.hidden_size],
            Role::Q => vec![q_width, c.hidden_size],
            Role::K | Role::V => vec![kv_width, c.hidden_size],
            Role::O => vec![c.hidden_size, q_width],
            Role::Gate | Role::Up => vec![c.intermediate_size, c.hidden_size],
            Role::Down => vec![c.hidden_size, c.intermediate_size],
        }
    }
}

/// Checks every tensor's shape against `config` before anything is read, then reads them
/// all as `dtype`, with a progress bar on a terminal.
pub(crate) fn load_weights(
    source: &dyn TensorSource,
    layout: &Layout,
    config: &LlamaConfig,
    dtype: DType,
) -> Result<Weights> {
    let layer_roles = [
        Role::InputNorm,
        Role::Q,
        Role::K,
        Role::V,
        Role::O,
        Role::PostAttentionNorm,
        Role::Gate,
        Role::Up,
        Role::Down,
    ];
    // A tied checkpoint may still store a copy of the embedding as lm_head; it is not read.
    let read_lm_head = !config.tie_word_embeddings;
    let mut wanted: Vec<(Role, usize)> = vec![(Role::Embed, 0)];
    for layer in 0..config.num_hidden_layers {
        wanted.extend(layer_roles.iter().map(|&role| (role, layer)));
    }
    wanted.push((Role::FinalNorm, 0));
    if read_lm_head {
        wanted.push((Role::LmHead, 0));
    }
    for &(role, layer) in &wanted {
        let name = (layout.name)(role, layer);
        let found = source
            .shape(&name)
            .ok_or_else(|| ModelError::MissingTensor {
                path: source.path().to_path_buf(),
                tensor: name.clone(),
            })?;
        let expected = role.expected_shape(config);
        if found != expected {
            return Err(ModelError::ShapeMismatch {
                tensor: name,
                expected,
                found,
            });
        }
    }

    let file = source
        .path()
        .file_name()
        .unwrap_or(source.path().as_os_str());
    let progress = progress_bar(
        wanted.len() as u64,
        format!("loading {}", file.to_string_lossy()),
    );
    let read = |role: Role, layer: usize| -> Result<HostTensor> {
        let name = (layout.name)(role, layer);
        progress.set_message(name.clone());
        let mut tensor = source.read(&name, dtype)?;
        if layout.qk_rows_permuted {
            match role {
                Role::Q => unpermute_rows(&mut tensor, config.num_attention_heads),
                Role::K => unpermute_rows(&mut tensor, config.num_key_value_heads),
                _ => {}
            }
        }
        progress.inc(1);
        Ok(tensor)
    };
    let embed_tokens = read(Role::Embed, 0)?;
    let layers = (0..config.num_hidden_layers)
        .map(|layer| {
            Ok(LayerWeights {
                input_norm: read(Role::InputNorm, layer)?,
                q_proj: read(Role::Q, layer)?,
                k_proj: read(Role::K, layer)?,
                v_proj: read(Role::V, layer)?,
                o_proj: read(Role::O, layer)?,
                post_attention_norm: read(Role::PostAttentionNorm, layer)?,
                gate_proj: read(Role::Gate, layer)?,
                up_proj: read(Role::Up, layer)?,
                down_proj: read(Role::Down, layer)?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let norm = read(Role::FinalNorm, 0)?;
    let lm_head = if read_lm_head {
        Some(read(Role::LmHead, 0)?)
    } else {
        None
    };
    progress.finish_and_clear();
    Ok(Weights {
        embed_tokens,
        layers,
        norm,
        lm_head,
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

/// Undoes llama.cpp's row permutation of a Q or K weight (`n_head` heads; for K the
/// key-value head count), so the tensor equals transformers' own.
pub(crate) fn unpermute_rows(tensor: &mut HostTensor, n_head: usize) {
    let rows = tensor.shape[0];
    let cols = tensor.len() / rows.max(1);
    let order = stored_row_of_hf_row(rows, n_head);
    tensor.data = gather_rows(&tensor.data, cols, &order);
}

/// Row `r` of the result is row `order[r]` of `data`.
fn gather_rows(data: &TypedVec, cols: usize, order: &[usize]) -> TypedVec {
    fn gather<T: Copy>(src: &[T], cols: usize, order: &[usize]) -> Vec<T> {
        order
            .iter()
            .flat_map(|&row| &src[row * cols..(row + 1) * cols])
            .copied()
            .collect()
    }
    match data {
        TypedVec::F32(v) => TypedVec::F32(gather(v, cols, order)),
        TypedVec::F16(v) => TypedVec::F16(gather(v, cols, order)),
        TypedVec::Bf16(v) => TypedVec::Bf16(gather(v, cols, order)),
    }
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

    fn tensor_of(rows: &[Vec<f32>]) -> HostTensor {
        let flat: Vec<f32> = rows.iter().flatten().copied().collect();
        HostTensor {
            shape: vec![rows.len(), rows[0].len()],
            data: TypedVec::F32(flat),
        }
    }

    #[test]
    fn unpermute_inverts_llama_cpp_permute() {
        for (n_head, head_dim) in [(1, 2), (3, 4), (2, 8), (9, 64)] {
            let rows: Vec<Vec<f32>> = (0..n_head * head_dim)
                .map(|r| vec![r as f32, -(r as f32)])
                .collect();
            let mut tensor = tensor_of(&llama_cpp_permute(&rows, n_head));
            unpermute_rows(&mut tensor, n_head);
            assert_eq!(tensor, tensor_of(&rows), "{n_head} heads of {head_dim}");
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
}
