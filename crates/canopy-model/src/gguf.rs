//! A reader for GGUF files (versions 2 and 3, little-endian), the format llama.cpp writes.
//!
//! A GGUF file is a header (magic `GGUF`, version, tensor count, metadata count), the metadata
//! key-value pairs, one info record per tensor (name, dims innermost first, ggml type, offset
//! into the data section), padding to `general.alignment` (32 by default) and the data section.
//! The file is memory-mapped; metadata is parsed eagerly, tensor data is read (and
//! dequantized) only when asked for. Every length and offset read from the file is checked
//! against the file's size before it is used, so a truncated or corrupt file is an error, not
//! a panic.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use canopy_core::DType;
use memmap2::Mmap;

use crate::error::{ModelError, Result};
use crate::quant::{self, GgmlType};
use crate::weights::{HostTensor, LayerPart, Layout, TensorFile, TensorSource, WeightId};

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml tensors have at most four dimensions.
const MAX_DIMS: u32 = 4;

/// One metadata value. Arrays may nest, as the format allows.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Vec<GgufValue>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl GgufValue {
    /// The value as a non-negative integer, whichever integer type the writer chose.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            GgufValue::U8(v) => Some(v.into()),
            GgufValue::U16(v) => Some(v.into()),
            GgufValue::U32(v) => Some(v.into()),
            GgufValue::U64(v) => Some(v),
            GgufValue::I8(v) => u64::try_from(v).ok(),
            GgufValue::I16(v) => u64::try_from(v).ok(),
            GgufValue::I32(v) => u64::try_from(v).ok(),
            GgufValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(v.into()),
            GgufValue::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            GgufValue::Bool(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            GgufValue::Array(items) => Some(items),
            _ => None,
        }
    }
}

/// Where one tensor lives in the data section and how it is stored.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufTensorInfo {
    pub name: String,
    /// ggml's `ne`: innermost (contiguous) dimension first, the reverse of row-major shapes.
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Offset from the start of the data section.
    pub offset: u64,
}

impl GgufTensorInfo {
    /// The row-major shape, outermost first: ggml's `ne = [in, out]` is `[out, in]` here.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }

    fn element_count(&self) -> Option<u64> {
        self.dims.iter().try_fold(1u64, |n, &d| n.checked_mul(d))
    }
}

/// A parsed, memory-mapped GGUF file.
pub struct GgufFile {
    path: PathBuf,
    file: File,
    mmap: Mmap,
    version: u32,
    metadata: HashMap<String, GgufValue>,
    tensors: Vec<GgufTensorInfo>,
    tensor_index: HashMap<String, usize>,
    data_start: usize,
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(|e| ModelError::io(path, e))?;
        // SAFETY: the map is read-only; canopy never writes model files, and a file truncated
        // by another process while mapped is outside what any mmap-based reader can guard.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| ModelError::io(path, e))?;
        Self::parse(path.to_path_buf(), file, mmap)
    }

    fn parse(path: PathBuf, file: File, mmap: Mmap) -> Result<Self> {
        let corrupt = |reason: String| ModelError::CorruptGguf {
            path: path.clone(),
            reason,
        };
        let mut cursor = Cursor::new(&mmap);
        let magic = cursor.bytes(4).map_err(&corrupt)?;
        if magic != MAGIC {
            return Err(corrupt(format!(
                "bad magic {magic:02x?} (expected the bytes of \"GGUF\")"
            )));
        }
        let version = cursor.u32().map_err(&corrupt)?;
        match version {
            2 | 3 => {}
            1 => return Err(corrupt(
                "GGUF version 1 is not supported; convert the model again with a current llama.cpp"
                    .into(),
            )),
            v if matches!(v.swap_bytes(), 1..=3) => {
                return Err(corrupt(
                    "the file is big-endian; canopy reads little-endian GGUF".into(),
                ))
            }
            v => return Err(corrupt(format!("unknown GGUF version {v}"))),
        }
        let tensor_count = cursor.u64().map_err(&corrupt)?;
        let metadata_count = cursor.u64().map_err(&corrupt)?;

        let mut metadata = HashMap::new();
        for _ in 0..metadata_count {
            let key = cursor.string().map_err(&corrupt)?;
            let value_type = cursor.u32().map_err(&corrupt)?;
            let value = cursor
                .value(value_type, 0)
                .map_err(|reason| corrupt(format!("metadata key {key}: {reason}")))?;
            metadata.insert(key, value);
        }

        let mut tensors = Vec::new();
        let mut tensor_index = HashMap::new();
        for _ in 0..tensor_count {
            let info = cursor.tensor_info().map_err(&corrupt)?;
            if tensor_index
                .insert(info.name.clone(), tensors.len())
                .is_some()
            {
                return Err(corrupt(format!("tensor {} is listed twice", info.name)));
            }
            tensors.push(info);
        }

        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(value) => match value.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() => a,
                _ => {
                    return Err(corrupt(format!(
                        "general.alignment {value:?} is not a power of two"
                    )))
                }
            },
        };
        let data_start = (cursor.pos as u64).div_ceil(alignment) * alignment;
        if data_start > mmap.len() as u64 {
            return Err(corrupt(format!(
                "the data section would start at byte {data_start}, past the end of the file ({} bytes): the file is truncated",
                mmap.len()
            )));
        }
        let gguf = GgufFile {
            data_start: data_start as usize,
            path,
            file,
            mmap,
            version,
            metadata,
            tensors,
            tensor_index,
        };
        for info in &gguf.tensors {
            if info.offset % alignment != 0 {
                return Err(gguf.corrupt(format!(
                    "tensor {} starts at offset {}, which is not a multiple of the alignment {alignment}",
                    info.name, info.offset
                )));
            }
            // Types canopy cannot read are reported when they are read, not here, so that
            // the error names the quantization rather than guessing at a size.
            if info.ggml_type.is_supported() {
                gguf.tensor_bytes(info)?;
            }
        }
        Ok(gguf)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn version(&self) -> u32 {
        self.version
    }

    pub fn metadata(&self) -> &HashMap<String, GgufValue> {
        &self.metadata
    }

    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.metadata.get(key)
    }

    pub fn tensors(&self) -> &[GgufTensorInfo] {
        &self.tensors
    }

    pub fn tensor_info(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// [`GgufFile::tensor_info`], or the error naming the missing tensor.
    fn info_of(&self, name: &str) -> Result<&GgufTensorInfo> {
        self.tensor_info(name)
            .ok_or_else(|| ModelError::MissingTensor {
                path: self.path.clone(),
                tensor: name.to_string(),
            })
    }

    pub(crate) fn corrupt(&self, reason: String) -> ModelError {
        ModelError::CorruptGguf {
            path: self.path.clone(),
            reason,
        }
    }

    fn missing(&self, key: &str) -> ModelError {
        ModelError::MissingMetadata {
            path: self.path.clone(),
            key: key.to_string(),
        }
    }

    fn wrong_type(&self, key: &str, expected: &'static str) -> ModelError {
        ModelError::MetadataType {
            path: self.path.clone(),
            key: key.to_string(),
            expected,
        }
    }

    /// An integer key that must be present.
    pub fn require_u64(&self, key: &str) -> Result<u64> {
        self.get_u64(key)?.ok_or_else(|| self.missing(key))
    }

    /// An integer key that may be absent; present with another type is an error.
    pub fn get_u64(&self, key: &str) -> Result<Option<u64>> {
        self.get(key)
            .map(|v| {
                v.as_u64()
                    .ok_or_else(|| self.wrong_type(key, "a non-negative integer"))
            })
            .transpose()
    }

    pub fn get_f64(&self, key: &str) -> Result<Option<f64>> {
        self.get(key)
            .map(|v| v.as_f64().ok_or_else(|| self.wrong_type(key, "a number")))
            .transpose()
    }

    pub fn require_str(&self, key: &str) -> Result<&str> {
        self.get_str(key)?.ok_or_else(|| self.missing(key))
    }

    pub fn get_str(&self, key: &str) -> Result<Option<&str>> {
        self.get(key)
            .map(|v| v.as_str().ok_or_else(|| self.wrong_type(key, "a string")))
            .transpose()
    }

    pub fn get_bool(&self, key: &str) -> Result<Option<bool>> {
        self.get(key)
            .map(|v| v.as_bool().ok_or_else(|| self.wrong_type(key, "a bool")))
            .transpose()
    }

    /// An array that may be absent, each item read by `item`; `what` names the array's type
    /// for the error when an item does not read.
    fn get_array<'a, T>(
        &'a self,
        key: &str,
        what: &'static str,
        item: impl Fn(&'a GgufValue) -> Option<T>,
    ) -> Result<Option<Vec<T>>> {
        let Some(value) = self.get(key) else {
            return Ok(None);
        };
        value
            .as_array()
            .and_then(|items| items.iter().map(item).collect::<Option<Vec<_>>>())
            .map(Some)
            .ok_or_else(|| self.wrong_type(key, what))
    }

    /// An array of strings that may be absent.
    pub fn get_strings(&self, key: &str) -> Result<Option<Vec<&str>>> {
        self.get_array(key, "an array of strings", GgufValue::as_str)
    }

    /// An array of integers (of any width and sign) that may be absent.
    pub fn get_ints(&self, key: &str) -> Result<Option<Vec<i64>>> {
        self.get_array(key, "an array of integers", |v| match *v {
            GgufValue::I8(x) => Some(x.into()),
            GgufValue::I16(x) => Some(x.into()),
            GgufValue::I32(x) => Some(x.into()),
            GgufValue::I64(x) => Some(x),
            _ => v.as_u64().and_then(|x| i64::try_from(x).ok()),
        })
    }

    /// An array of numbers that may be absent, as f64.
    pub fn get_floats(&self, key: &str) -> Result<Option<Vec<f64>>> {
        self.get_array(key, "an array of numbers", GgufValue::as_f64)
    }

    /// The bytes of one tensor, after checking that they lie inside the file.
    fn tensor_bytes(&self, info: &GgufTensorInfo) -> Result<&[u8]> {
        let elements = info.element_count().ok_or_else(|| {
            self.corrupt(format!(
                "tensor {} has dims {:?}, too many elements",
                info.name, info.dims
            ))
        })?;
        let inner = info.dims.first().copied().unwrap_or(1);
        let (block_elems, block_bytes) =
            info.ggml_type
                .block_layout()
                .ok_or_else(|| ModelError::UnsupportedQuantization {
                    ggml_type: info.ggml_type.name(),
                    tensor: info.name.clone(),
                })?;
        if inner % block_elems != 0 {
            return Err(self.corrupt(format!(
                "tensor {} ({}) has an innermost dimension of {inner}, not a multiple of its block size {block_elems}",
                info.name,
                info.ggml_type.name()
            )));
        }
        let available = (self.mmap.len() - self.data_start) as u64;
        let size = (elements / block_elems).saturating_mul(block_bytes);
        match info.offset.checked_add(size) {
            Some(end) if end <= available => {
                let start = self.data_start + info.offset as usize;
                Ok(&self.mmap[start..start + size as usize])
            }
            _ => Err(self.corrupt(format!(
                "tensor {} needs bytes {}..{} of the data section, which has {available}: the file is truncated",
                info.name,
                info.offset,
                info.offset as u128 + size as u128
            ))),
        }
    }

    /// Reads tensor `name` into host memory as `dtype`, dequantizing as it goes, in
    /// row-major shape (ggml's dims reversed).
    pub fn read_tensor(&self, name: &str, dtype: DType) -> Result<HostTensor> {
        let info = self.info_of(name)?;
        let bytes = self.tensor_bytes(info)?;
        let data =
            quant::dequantize(info.ggml_type, bytes, dtype).ok_or_else(|| unsupported(info))?;
        Ok(HostTensor {
            shape: info.shape(),
            data,
        })
    }
}

/// The error for a tensor of a type canopy does not read.
fn unsupported(info: &GgufTensorInfo) -> ModelError {
    ModelError::UnsupportedQuantization {
        ggml_type: info.ggml_type.name(),
        tensor: info.name.clone(),
    }
}

/// Arrays nest at most this deep; deeper is treated as corruption rather than recursed into.
const MAX_ARRAY_NESTING: usize = 8;

/// Reads little-endian values from a byte slice, failing (with the reason) past its end.
struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn new(bytes: &'a [u8]) -> Self {
        Cursor { bytes, pos: 0 }
    }

    fn bytes(&mut self, len: u64) -> Result<&'a [u8], String> {
        let remaining = (self.bytes.len() - self.pos) as u64;
        if len > remaining {
            return Err(format!(
                "needs {len} bytes at offset {}, but the file ends {remaining} bytes later: the file is truncated",
                self.pos
            ));
        }
        let start = self.pos;
        self.pos += len as usize;
        Ok(&self.bytes[start..self.pos])
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], String> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.bytes(N as u64)?);
        Ok(out)
    }

    fn u32(&mut self) -> Result<u32, String> {
        self.array().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Result<u64, String> {
        self.array().map(u64::from_le_bytes)
    }

    fn string(&mut self) -> Result<String, String> {
        let len = self.u64()?;
        let bytes = self.bytes(len)?;
        Ok(String::from_utf8_lossy(bytes).into_owned())
    }

    /// One value of GGUF type `value_type` (0..=12).
    fn value(&mut self, value_type: u32, depth: usize) -> Result<GgufValue, String> {
        Ok(match value_type {
            0 => GgufValue::U8(u8::from_le_bytes(self.array()?)),
            1 => GgufValue::I8(i8::from_le_bytes(self.array()?)),
            2 => GgufValue::U16(u16::from_le_bytes(self.array()?)),
            3 => GgufValue::I16(i16::from_le_bytes(self.array()?)),
            4 => GgufValue::U32(self.u32()?),
            5 => GgufValue::I32(i32::from_le_bytes(self.array()?)),
            6 => GgufValue::F32(f32::from_le_bytes(self.array()?)),
            7 => match self.array::<1>()?[0] {
                0 => GgufValue::Bool(false),
                1 => GgufValue::Bool(true),
                b => return Err(format!("bool byte {b} at offset {}", self.pos - 1)),
            },
            8 => GgufValue::String(self.string()?),
            9 => {
                if depth >= MAX_ARRAY_NESTING {
                    return Err(format!("arrays nested more than {MAX_ARRAY_NESTING} deep"));
                }
                let item_type = self.u32()?;
                let len = self.u64()?;
                // Every item takes at least one byte, so a count beyond the bytes left is
                // corruption; checking first keeps a bad count from reserving huge memory.
                let remaining = (self.bytes.len() - self.pos) as u64;
                if len > remaining {
                    return Err(format!(
                        "an array of {len} items at offset {} cannot fit in the {remaining} bytes left",
                        self.pos
                    ));
                }
                let mut items = Vec::with_capacity(len as usize);
                for _ in 0..len {
                    items.push(self.value(item_type, depth + 1)?);
                }
                GgufValue::Array(items)
            }
            10 => GgufValue::U64(self.u64()?),
            11 => GgufValue::I64(i64::from_le_bytes(self.array()?)),
            12 => GgufValue::F64(f64::from_le_bytes(self.array()?)),
            t => return Err(format!("unknown metadata value type {t}")),
        })
    }

    fn tensor_info(&mut self) -> Result<GgufTensorInfo, String> {
        let name = self.string()?;
        let n_dims = self.u32()?;
        if n_dims > MAX_DIMS {
            return Err(format!(
                "tensor {name} has {n_dims} dimensions; ggml allows at most {MAX_DIMS}"
            ));
        }
        let dims = (0..n_dims)
            .map(|_| self.u64())
            .collect::<Result<Vec<_>, _>>()?;
        let ggml_type = GgmlType(self.u32()?);
        let offset = self.u64()?;
        Ok(GgufTensorInfo {
            name,
            dims,
            ggml_type,
            offset,
        })
    }
}

/// llama.cpp's tensor names for a Llama model.
fn gguf_name(id: WeightId) -> String {
    match id {
        WeightId::Embed => "token_embd.weight".into(),
        WeightId::Layer(layer, part) => {
            let suffix = match part {
                LayerPart::InputNorm => "attn_norm",
                LayerPart::Q => "attn_q",
                LayerPart::K => "attn_k",
                LayerPart::V => "attn_v",
                LayerPart::O => "attn_output",
                LayerPart::PostNorm => "ffn_norm",
                LayerPart::Gate => "ffn_gate",
                LayerPart::Up => "ffn_up",
                LayerPart::Down => "ffn_down",
            };
            format!("blk.{layer}.{suffix}.weight")
        }
        WeightId::FinalNorm => "output_norm.weight".into(),
        WeightId::LmHead => "output.weight".into(),
    }
}

/// llama.cpp names tensors its own way and stores Q and K rows permuted for its RoPE.
pub(crate) const GGUF_LAYOUT: Layout = Layout {
    name: gguf_name,
    qk_rows_permuted: true,
};

impl TensorSource for GgufFile {
    fn path(&self) -> &Path {
        &self.path
    }

    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.tensor_info(name).map(GgufTensorInfo::shape)
    }

    fn stored(&self, name: &str) -> Result<(GgmlType, &[u8])> {
        let info = self.info_of(name)?;
        let bytes = self.tensor_bytes(info)?;
        match info.ggml_type.block_layout() {
            Some(_) => Ok((info.ggml_type, bytes)),
            None => Err(unsupported(info)),
        }
    }

    fn file_of(&self, name: &str) -> Option<TensorFile<'_>> {
        self.tensor_info(name).map(|_| TensorFile {
            file: &self.file,
            map: &self.mmap,
            path: &self.path,
        })
    }
}
