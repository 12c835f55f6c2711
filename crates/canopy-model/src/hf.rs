//! Weights of a Hugging Face model directory: `model.safetensors`, or the shards listed by
//! `model.safetensors.index.json`, each memory-mapped and its header checked by the
//! `safetensors` crate (offsets inside the file, sizes matching shapes) before any tensor is
//! read.

use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::{Dtype, SafeTensors};
use serde::Deserialize;

use crate::error::{ModelError, Result};
use crate::quant::GgmlType;
use crate::weights::{LayerPart, Layout, TensorFile, TensorSource, WeightId};

/// The bytes before a safetensors header: its length as a little-endian u64.
const HEADER_LENGTH_BYTES: usize = 8;

/// transformers' tensor names for a `LlamaForCausalLM`.
fn hf_name(id: WeightId) -> String {
    match id {
        WeightId::Embed => "model.embed_tokens.weight".into(),
        WeightId::Layer(layer, part) => {
            let suffix = match part {
                LayerPart::InputNorm => "input_layernorm",
                LayerPart::Q => "self_attn.q_proj",
                LayerPart::K => "self_attn.k_proj",
                LayerPart::V => "self_attn.v_proj",
                LayerPart::O => "self_attn.o_proj",
                LayerPart::PostNorm => "post_attention_layernorm",
                LayerPart::Gate => "mlp.gate_proj",
                LayerPart::Up => "mlp.up_proj",
                LayerPart::Down => "mlp.down_proj",
            };
            format!("model.layers.{layer}.{suffix}.weight")
        }
        WeightId::FinalNorm => "model.norm.weight".into(),
        WeightId::LmHead => "lm_head.weight".into(),
    }
}

/// Safetensors files name tensors as transformers does and store Q and K in HF's row order.
pub(crate) const HF_LAYOUT: Layout = Layout {
    name: hf_name,
    qk_rows_permuted: false,
};

struct Shard {
    path: PathBuf,
    file: File,
    mmap: Mmap,
    header_len: usize,
    metadata: Metadata,
}

/// The safetensors file(s) of one model directory.
pub(crate) struct SafetensorsSource {
    dir: PathBuf,
    shards: Vec<Shard>,
    shard_of_tensor: HashMap<String, usize>,
}

#[derive(Deserialize)]
struct ShardIndex {
    weight_map: HashMap<String, String>,
}

impl SafetensorsSource {
    /// Maps `model.safetensors`, or every shard named in `model.safetensors.index.json`.
    pub(crate) fn open(dir: &Path) -> Result<Self> {
        let single = dir.join("model.safetensors");
        let index_path = dir.join("model.safetensors.index.json");
        let shard_paths: Vec<PathBuf> = if single.is_file() {
            vec![single]
        } else if index_path.is_file() {
            let text =
                std::fs::read_to_string(&index_path).map_err(|e| ModelError::io(&index_path, e))?;
            let index: ShardIndex =
                serde_json::from_str(&text).map_err(|source| ModelError::Json {
                    path: index_path.clone(),
                    source,
                })?;
            let files: BTreeSet<String> = index.weight_map.into_values().collect();
            files.into_iter().map(|file| dir.join(file)).collect()
        } else {
            return Err(ModelError::MissingFile {
                dir: dir.to_path_buf(),
                file: "model.safetensors (or model.safetensors.index.json)".into(),
            });
        };

        let mut shards = Vec::with_capacity(shard_paths.len());
        let mut shard_of_tensor = HashMap::new();
        for path in shard_paths {
            if !path.is_file() {
                return Err(ModelError::MissingFile {
                    dir: dir.to_path_buf(),
                    file: path
                        .file_name()
                        .map_or_else(String::new, |f| f.to_string_lossy().into_owned()),
                });
            }
            let file = File::open(&path).map_err(|e| ModelError::io(&path, e))?;
            // SAFETY: read-only map of a file canopy never writes.
            let mmap = unsafe { Mmap::map(&file) }.map_err(|e| ModelError::io(&path, e))?;
            let (header_len, metadata) =
                SafeTensors::read_metadata(&mmap).map_err(|source| ModelError::Safetensors {
                    path: path.clone(),
                    source,
                })?;
            for name in metadata.offset_keys() {
                shard_of_tensor.insert(name, shards.len());
            }
            shards.push(Shard {
                path,
                file,
                mmap,
                header_len,
                metadata,
            });
        }
        Ok(SafetensorsSource {
            dir: dir.to_path_buf(),
            shards,
            shard_of_tensor,
        })
    }

    fn shard(&self, name: &str) -> Option<&Shard> {
        self.shard_of_tensor.get(name).map(|&i| &self.shards[i])
    }

    /// Tensor `name`'s shard and entry, and its element type as ggml names it: safetensors'
    /// unquantized floats are stored exactly as ggml's F32, F16 and BF16.
    fn stored_type(&self, name: &str) -> Result<(&Shard, &TensorInfo, GgmlType)> {
        let missing = || ModelError::MissingTensor {
            path: self.dir.clone(),
            tensor: name.to_string(),
        };
        let shard = self.shard(name).ok_or_else(missing)?;
        let info = shard.metadata.info(name).ok_or_else(missing)?;
        let stored = match info.dtype {
            Dtype::F32 => GgmlType::F32,
            Dtype::F16 => GgmlType::F16,
            Dtype::BF16 => GgmlType::BF16,
            other => {
                return Err(ModelError::UnsupportedDtype {
                    path: shard.path.clone(),
                    tensor: name.to_string(),
                    dtype: format!("{other:?}"),
                })
            }
        };
        Ok((shard, info, stored))
    }
}

impl TensorSource for SafetensorsSource {
    fn path(&self) -> &Path {
        &self.dir
    }

    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        Some(self.shard(name)?.metadata.info(name)?.shape.clone())
    }

    fn stored(&self, name: &str) -> Result<(GgmlType, &[u8])> {
        let (shard, info, stored) = self.stored_type(name)?;
        let (begin, end) = info.data_offsets;
        let data_start = HEADER_LENGTH_BYTES + shard.header_len;
        // read_metadata checked the offsets against the file; `get` keeps that a non-panic.
        let bytes = shard
            .mmap
            .get(data_start + begin..data_start + end)
            .ok_or_else(|| ModelError::Safetensors {
                path: shard.path.clone(),
                source: safetensors::SafeTensorError::InvalidOffset(name.to_string()),
            })?;
        Ok((stored, bytes))
    }

    fn file_of(&self, name: &str) -> Option<TensorFile<'_>> {
        self.shard(name).map(|shard| TensorFile {
            file: &shard.file,
            map: &shard.mmap,
            path: &shard.path,
        })
    }
}
