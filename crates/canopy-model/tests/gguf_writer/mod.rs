//! A minimal GGUF writer (version 3, little-endian) and ggml's reference quantizers, for the
//! tests that write their own GGUF files.

use std::path::Path;

use canopy_model::GgmlType;
use half::f16;

pub enum Meta {
    U32(u32),
    F32(f32),
    Bool(bool),
    Str(String),
    Strs(Vec<String>),
    I32s(Vec<i32>),
}

struct Tensor {
    name: String,
    /// ggml order: innermost first.
    dims: Vec<u64>,
    ggml_type: u32,
    bytes: Vec<u8>,
}

#[derive(Default)]
pub struct GgufWriter {
    metadata: Vec<(String, Meta)>,
    tensors: Vec<Tensor>,
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

impl GgufWriter {
    pub fn meta(&mut self, key: &str, value: Meta) {
        self.metadata.retain(|(k, _)| k != key);
        self.metadata.push((key.to_string(), value));
    }

    /// Adds a row-major `[rows, cols]` (or `[cols]`) tensor stored as `ggml_type`.
    pub fn tensor(&mut self, name: &str, shape: &[usize], ggml_type: GgmlType, values: &[f32]) {
        let bytes = match ggml_type {
            GgmlType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            GgmlType::F16 => values
                .iter()
                .flat_map(|v| f16::from_f32(*v).to_le_bytes())
                .collect(),
            GgmlType::Q8_0 => values.chunks(32).flat_map(quantize_q8_0).collect(),
            GgmlType::Q4_0 => values.chunks(32).flat_map(quantize_q4_0).collect(),
            GgmlType::Q4_1 => values.chunks(32).flat_map(quantize_q4_1).collect(),
            other => panic!("the test writer does not quantize {}", other.name()),
        };
        self.raw_tensor(name, shape, ggml_type.0, bytes);
    }

    pub fn raw_tensor(&mut self, name: &str, shape: &[usize], ggml_type: u32, bytes: Vec<u8>) {
        self.tensors.retain(|t| t.name != name);
        self.tensors.push(Tensor {
            name: name.to_string(),
            dims: shape.iter().rev().map(|&d| d as u64).collect(),
            ggml_type,
            bytes,
        });
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        const ALIGNMENT: usize = 32;
        let mut out = b"GGUF".to_vec();
        out.extend(3u32.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend((self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            put_str(&mut out, key);
            match value {
                Meta::U32(v) => {
                    out.extend(4u32.to_le_bytes());
                    out.extend(v.to_le_bytes());
                }
                Meta::F32(v) => {
                    out.extend(6u32.to_le_bytes());
                    out.extend(v.to_le_bytes());
                }
                Meta::Bool(v) => {
                    out.extend(7u32.to_le_bytes());
                    out.push(u8::from(*v));
                }
                Meta::Str(s) => {
                    out.extend(8u32.to_le_bytes());
                    put_str(&mut out, s);
                }
                Meta::Strs(items) => {
                    out.extend(9u32.to_le_bytes());
                    out.extend(8u32.to_le_bytes());
                    out.extend((items.len() as u64).to_le_bytes());
                    items.iter().for_each(|s| put_str(&mut out, s));
                }
                Meta::I32s(items) => {
                    out.extend(9u32.to_le_bytes());
                    out.extend(5u32.to_le_bytes());
                    out.extend((items.len() as u64).to_le_bytes());
                    items.iter().for_each(|v| out.extend(v.to_le_bytes()));
                }
            }
        }
        let mut offset = 0usize;
        let mut offsets = Vec::new();
        for tensor in &self.tensors {
            put_str(&mut out, &tensor.name);
            out.extend((tensor.dims.len() as u32).to_le_bytes());
            tensor.dims.iter().for_each(|d| out.extend(d.to_le_bytes()));
            out.extend(tensor.ggml_type.to_le_bytes());
            out.extend((offset as u64).to_le_bytes());
            offsets.push(offset);
            offset = (offset + tensor.bytes.len()).div_ceil(ALIGNMENT) * ALIGNMENT;
        }
        out.resize(out.len().div_ceil(ALIGNMENT) * ALIGNMENT, 0);
        let data_start = out.len();
        for (tensor, offset) in self.tensors.iter().zip(offsets) {
            out.resize(data_start + offset, 0);
            out.extend(&tensor.bytes);
        }
        out
    }

    pub fn write(&self, path: &Path) {
        std::fs::write(path, self.to_bytes()).unwrap();
    }
}

fn f16_round(x: f32) -> f32 {
    f16::from_f32(x).to_f32()
}

/// ggml's `quantize_row_q8_0_ref`: `d = amax / 127`, `q = round(x / d)`.
fn quantize_q8_0(block: &[f32]) -> Vec<u8> {
    let amax = block.iter().fold(0f32, |m, x| m.max(x.abs()));
    let d = amax / 127.0;
    let inverse = if d == 0.0 { 0.0 } else { 1.0 / d };
    let mut out = f16::from_f32(d).to_le_bytes().to_vec();
    out.extend(block.iter().map(|x| (x * inverse).round() as i8 as u8));
    out
}

/// ggml's `quantize_row_q4_0_ref`: `d = max / -8` for the value of largest magnitude.
fn quantize_q4_0(block: &[f32]) -> Vec<u8> {
    let max = block
        .iter()
        .fold(0f32, |m, &x| if x.abs() > m.abs() { x } else { m });
    let d = max / -8.0;
    let inverse = if d == 0.0 { 0.0 } else { 1.0 / d };
    let q = |x: f32| ((x * inverse + 8.5) as u8).min(15);
    let mut out = f16::from_f32(d).to_le_bytes().to_vec();
    out.extend((0..16).map(|j| q(block[j]) | q(block[j + 16]) << 4));
    out
}

/// ggml's `quantize_row_q4_1_ref`: `d = (max - min) / 15`, `m = min`.
fn quantize_q4_1(block: &[f32]) -> Vec<u8> {
    let min = block.iter().copied().fold(f32::INFINITY, f32::min);
    let max = block.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let d = (max - min) / 15.0;
    let inverse = if d == 0.0 { 0.0 } else { 1.0 / d };
    let q = |x: f32| (((x - min) * inverse + 0.5) as u8).min(15);
    let mut out = f16::from_f32(d).to_le_bytes().to_vec();
    out.extend(f16::from_f32(min).to_le_bytes());
    out.extend((0..16).map(|j| q(block[j]) | q(block[j + 16]) << 4));
    out
}

/// Element `i` of a block's 16 packed bytes: low nibbles first, then high nibbles.
fn nibble(packed: &[u8], i: usize) -> u8 {
    if i < 16 {
        packed[i] & 15
    } else {
        packed[i - 16] >> 4
    }
}

/// What each stored block decodes to, computed from its fields by the formulas of
/// ggml's `dequantize_row_*` (independently of the crate's dequantizer).
pub fn expected_dequantized(ggml_type: GgmlType, values: &[f32]) -> Vec<f32> {
    let half = |b: &[u8]| f16::from_le_bytes([b[0], b[1]]).to_f32();
    let mut out = Vec::new();
    for block in values.chunks(32) {
        match ggml_type {
            GgmlType::F32 => out.extend(block),
            GgmlType::F16 => out.extend(block.iter().map(|&x| f16_round(x))),
            GgmlType::Q8_0 => {
                let raw = quantize_q8_0(block);
                out.extend(raw[2..].iter().map(|&q| f32::from(q as i8) * half(&raw)));
            }
            GgmlType::Q4_0 => {
                let raw = quantize_q4_0(block);
                let nib = |i| nibble(&raw[2..], i);
                out.extend((0..32).map(|i| (f32::from(nib(i)) - 8.0) * half(&raw)));
            }
            GgmlType::Q4_1 => {
                let raw = quantize_q4_1(block);
                let nib = |i| nibble(&raw[4..], i);
                out.extend((0..32).map(|i| f32::from(nib(i)) * half(&raw) + half(&raw[2..])));
            }
            other => panic!("no reference for {}", other.name()),
        }
    }
    out
}
