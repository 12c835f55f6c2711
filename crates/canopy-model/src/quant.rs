//! ggml's tensor types and the dequantization of those canopy reads.
//!
//! Quantized types store blocks of 32 consecutive elements of a row (ggml's `QK4_0`,
//! `QK4_1`, `QK8_0`), each block with its own scale:
//!
//! | type | block bytes | layout | element `i` |
//! |---|---|---|---|
//! | Q8_0 | 34 | f16 `d`, 32 × i8 `q` | `q[i] * d` |
//! | Q4_0 | 18 | f16 `d`, 16 bytes of nibbles | `(nibble(i) - 8) * d` |
//! | Q4_1 | 20 | f16 `d`, f16 `m`, 16 bytes of nibbles | `nibble(i) * d + m` |
//!
//! where `nibble(i)` is the low nibble of byte `i` for `i < 16` and the high nibble of byte
//! `i - 16` otherwise. Every type converts straight into the requested [`DType`], one block at
//! a time, so no full-size f32 copy of a tensor is ever held.

use canopy_core::{DType, TypedVec};
use half::{bf16, f16};

/// A ggml tensor type id, as stored in a GGUF tensor info.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GgmlType(pub u32);

impl GgmlType {
    pub const F32: GgmlType = GgmlType(0);
    pub const F16: GgmlType = GgmlType(1);
    pub const Q4_0: GgmlType = GgmlType(2);
    pub const Q4_1: GgmlType = GgmlType(3);
    pub const Q8_0: GgmlType = GgmlType(8);
    pub const BF16: GgmlType = GgmlType(30);

    /// ggml's name for the type, for error messages; ids retired from ggml read `type N`.
    pub fn name(self) -> String {
        const NAMES: [&str; 40] = [
            "F32", "F16", "Q4_0", "Q4_1", "", "", "Q5_0", "Q5_1", "Q8_0", "Q8_1", "Q2_K", "Q3_K",
            "Q4_K", "Q5_K", "Q6_K", "Q8_K", "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ4_NL",
            "IQ3_S", "IQ2_S", "IQ4_XS", "I8", "I16", "I32", "I64", "F64", "IQ1_M", "BF16", "", "",
            "", "TQ1_0", "TQ2_0", "", "", "", "MXFP4",
        ];
        match NAMES.get(self.0 as usize) {
            Some(name) if !name.is_empty() => name.to_string(),
            _ => format!("type {}", self.0),
        }
    }

    /// `(elements, bytes)` of one block, for the types canopy can read.
    pub fn block_layout(self) -> Option<(u64, u64)> {
        match self {
            GgmlType::F32 => Some((1, 4)),
            GgmlType::F16 | GgmlType::BF16 => Some((1, 2)),
            GgmlType::Q4_0 => Some((32, 18)),
            GgmlType::Q4_1 => Some((32, 20)),
            GgmlType::Q8_0 => Some((32, 34)),
            _ => None,
        }
    }

    pub fn is_supported(self) -> bool {
        self.block_layout().is_some()
    }
}

/// Appends f32 values to typed storage, rounding to the storage type.
struct Sink {
    out: TypedVec,
}

impl Sink {
    fn with_capacity(dtype: DType, len: usize) -> Self {
        let out = match dtype {
            DType::F32 => TypedVec::F32(Vec::with_capacity(len)),
            DType::F16 => TypedVec::F16(Vec::with_capacity(len)),
            DType::Bf16 => TypedVec::Bf16(Vec::with_capacity(len)),
        };
        Sink { out }
    }

    fn extend(&mut self, values: &[f32]) {
        match &mut self.out {
            TypedVec::F32(v) => v.extend_from_slice(values),
            TypedVec::F16(v) => v.extend(values.iter().map(|&x| f16::from_f32(x))),
            TypedVec::Bf16(v) => v.extend(values.iter().map(|&x| bf16::from_f32(x))),
        }
    }
}

/// The f16 stored little-endian at `bytes[0..2]`.
fn f16_at(bytes: &[u8]) -> f32 {
    f16::from_le_bytes([bytes[0], bytes[1]]).to_f32()
}

/// Dequantizes `bytes` (whole blocks of `ggml_type`) into `dtype`; `None` for a type canopy
/// does not read. The caller has checked that `bytes` holds whole blocks.
pub fn dequantize(ggml_type: GgmlType, bytes: &[u8], dtype: DType) -> Option<TypedVec> {
    let (block_elems, block_bytes) = ggml_type.block_layout()?;
    let len = bytes.len() / block_bytes as usize * block_elems as usize;
    // Unquantized sources of the same width as the target are copied bit for bit.
    match (ggml_type, dtype) {
        (GgmlType::F32, DType::F32) => {
            return Some(TypedVec::F32(decode_le(bytes, f32::from_le_bytes)))
        }
        (GgmlType::F16, DType::F16) => {
            return Some(TypedVec::F16(decode_le(bytes, f16::from_le_bytes)))
        }
        (GgmlType::BF16, DType::Bf16) => {
            return Some(TypedVec::Bf16(decode_le(bytes, bf16::from_le_bytes)))
        }
        _ => {}
    }
    let mut sink = Sink::with_capacity(dtype, len);
    let mut block = [0f32; 32];
    match ggml_type {
        GgmlType::F32 => {
            for chunk in bytes.chunks(4 * 32) {
                let n = chunk.len() / 4;
                for (x, b) in block.iter_mut().zip(chunk.chunks_exact(4)) {
                    *x = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
                sink.extend(&block[..n]);
            }
        }
        GgmlType::F16 | GgmlType::BF16 => {
            let to_f32: fn([u8; 2]) -> f32 = if ggml_type == GgmlType::F16 {
                |b: [u8; 2]| f16::from_le_bytes(b).to_f32()
            } else {
                |b: [u8; 2]| bf16::from_le_bytes(b).to_f32()
            };
            for chunk in bytes.chunks(2 * 32) {
                let n = chunk.len() / 2;
                for (x, b) in block.iter_mut().zip(chunk.chunks_exact(2)) {
                    *x = to_f32([b[0], b[1]]);
                }
                sink.extend(&block[..n]);
            }
        }
        GgmlType::Q8_0 => {
            for raw in bytes.chunks_exact(34) {
                let d = f16_at(raw);
                for (x, &q) in block.iter_mut().zip(&raw[2..]) {
                    *x = f32::from(q as i8) * d;
                }
                sink.extend(&block);
            }
        }
        GgmlType::Q4_0 => {
            for raw in bytes.chunks_exact(18) {
                let d = f16_at(raw);
                unpack_nibbles(&raw[2..], &mut block, |q| (f32::from(q) - 8.0) * d);
                sink.extend(&block);
            }
        }
        GgmlType::Q4_1 => {
            for raw in bytes.chunks_exact(20) {
                let d = f16_at(raw);
                let m = f16_at(&raw[2..]);
                unpack_nibbles(&raw[4..], &mut block, |q| f32::from(q) * d + m);
                sink.extend(&block);
            }
        }
        _ => return None,
    }
    Some(sink.out)
}

/// Elements 0..16 are the low nibbles of the 16 bytes, elements 16..32 the high nibbles.
fn unpack_nibbles(packed: &[u8], block: &mut [f32; 32], value: impl Fn(u8) -> f32) {
    let (low, high) = block.split_at_mut(16);
    for ((lo, hi), &byte) in low.iter_mut().zip(high.iter_mut()).zip(packed) {
        *lo = value(byte & 0x0f);
        *hi = value(byte >> 4);
    }
}

/// Reads a slice of little-endian `N`-byte values.
fn decode_le<T, const N: usize>(bytes: &[u8], from_le: fn([u8; N]) -> T) -> Vec<T> {
    bytes
        .chunks_exact(N)
        .map(|chunk| {
            let mut raw = [0u8; N];
            raw.copy_from_slice(chunk);
            from_le(raw)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f16_bytes(x: f32) -> [u8; 2] {
        f16::from_f32(x).to_le_bytes()
    }

    #[test]
    fn q8_0_scales_signed_bytes() {
        let mut block = f16_bytes(0.5).to_vec();
        block.extend((0..32).map(|i| (i as i8 - 16) as u8));
        let values = dequantize(GgmlType::Q8_0, &block, DType::F32)
            .unwrap()
            .to_f32_vec();
        let expected: Vec<f32> = (0..32).map(|i| (i as f32 - 16.0) * 0.5).collect();
        assert_eq!(values, expected);
    }

    #[test]
    fn q4_0_low_nibbles_first_then_high() {
        // Byte j holds element j (low nibble) and element j + 16 (high nibble).
        let mut block = f16_bytes(2.0).to_vec();
        block.extend((0..16u8).map(|j| (15 - j) << 4 | j));
        let values = dequantize(GgmlType::Q4_0, &block, DType::F32)
            .unwrap()
            .to_f32_vec();
        for j in 0..16 {
            assert_eq!(values[j], (j as f32 - 8.0) * 2.0, "element {j}");
            assert_eq!(
                values[j + 16],
                (15.0 - j as f32 - 8.0) * 2.0,
                "element {}",
                j + 16
            );
        }
    }

    #[test]
    fn q4_1_adds_the_minimum() {
        let mut block = f16_bytes(0.25).to_vec();
        block.extend(f16_bytes(-1.0));
        block.extend([0x10u8; 16]);
        let values = dequantize(GgmlType::Q4_1, &block, DType::F32)
            .unwrap()
            .to_f32_vec();
        assert!(values[..16].iter().all(|&v| v == -1.0));
        assert!(values[16..].iter().all(|&v| v == -0.75));
    }

    #[test]
    fn same_width_types_copy_bits() {
        let bits = [0x3f80u16, 0x7f80, 0x0001];
        let bytes: Vec<u8> = bits.iter().flat_map(|b| b.to_le_bytes()).collect();
        let TypedVec::Bf16(values) = dequantize(GgmlType::BF16, &bytes, DType::Bf16).unwrap()
        else {
            panic!("bf16 storage expected");
        };
        assert_eq!(values.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), bits);
    }

    #[test]
    fn unknown_types_are_named_and_refused() {
        assert_eq!(GgmlType(13).name(), "Q5_K");
        assert_eq!(GgmlType(4).name(), "type 4");
        assert!(dequantize(GgmlType(13), &[0; 176], DType::F32).is_none());
    }
}
