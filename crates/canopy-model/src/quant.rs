//! ggml's tensor types and the dequantization of those canopy reads.
//!
//! Quantized types store a row in blocks, each with its own scales. The 32-element types
//! (ggml's `QK4_0` family):
//!
//! | type | block bytes | layout | element `i` |
//! |---|---|---|---|
//! | Q8_0 | 34 | f16 `d`, 32 × i8 `q` | `q[i] * d` |
//! | Q4_0 | 18 | f16 `d`, 16 bytes of nibbles | `(nibble(i) - 8) * d` |
//! | Q4_1 | 20 | f16 `d`, f16 `m`, 16 bytes of nibbles | `nibble(i) * d + m` |
//! | Q5_0 | 22 | f16 `d`, 32 fifth bits, 16 bytes of nibbles | `(nibble(i) + 16 · bit(i) - 16) * d` |
//! | Q5_1 | 24 | f16 `d`, f16 `m`, 32 fifth bits, 16 bytes of nibbles | `(nibble(i) + 16 · bit(i)) * d + m` |
//! | IQ4_NL | 18 | f16 `d`, 16 bytes of nibbles | `IQ4_VALUES[nibble(i)] * d` |
//!
//! where `nibble(i)` is the low nibble of byte `i` for `i < 16` and the high nibble of byte
//! `i - 16` otherwise. The K-quants (`Q2_K` to `Q6_K`, the types of llama.cpp's `Q4_K_M` and
//! similar mixes) and IQ4_XS hold 256 elements a block in sub-blocks of 16 or 32, each with a
//! small integer scale (and for Q2_K, Q4_K and Q5_K a minimum) that the block's f16 scales
//! multiply; [`decode_k_block`] documents each layout. Every type converts straight into the
//! requested [`DType`], one block at a time, so no full-size f32 copy of a tensor is ever held.

mod codes;

use canopy_core::{coded_value, cut_at_multiples, CodedSliceMut, DType, TypedSliceMut, TypedVec};
pub use codes::code_group;
use codes::BlockBuffer;
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use rayon::prelude::*;

/// Elements of a K-quant block (ggml's `QK_K`).
const QK_K: usize = 256;

/// A ggml tensor type id, as stored in a GGUF tensor info.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GgmlType(pub u32);

impl GgmlType {
    pub const F32: GgmlType = GgmlType(0);
    pub const F16: GgmlType = GgmlType(1);
    pub const Q4_0: GgmlType = GgmlType(2);
    pub const Q4_1: GgmlType = GgmlType(3);
    pub const Q5_0: GgmlType = GgmlType(6);
    pub const Q5_1: GgmlType = GgmlType(7);
    pub const Q8_0: GgmlType = GgmlType(8);
    pub const Q2_K: GgmlType = GgmlType(10);
    pub const Q3_K: GgmlType = GgmlType(11);
    pub const Q4_K: GgmlType = GgmlType(12);
    pub const Q5_K: GgmlType = GgmlType(13);
    pub const Q6_K: GgmlType = GgmlType(14);
    pub const IQ4_NL: GgmlType = GgmlType(20);
    pub const IQ4_XS: GgmlType = GgmlType(23);
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
            GgmlType::Q5_0 => Some((32, 22)),
            GgmlType::Q5_1 => Some((32, 24)),
            GgmlType::Q8_0 => Some((32, 34)),
            GgmlType::Q2_K => Some((QK_K as u64, 84)),
            GgmlType::Q3_K => Some((QK_K as u64, 110)),
            GgmlType::Q4_K => Some((QK_K as u64, 144)),
            GgmlType::Q5_K => Some((QK_K as u64, 176)),
            GgmlType::Q6_K => Some((QK_K as u64, 210)),
            GgmlType::IQ4_NL => Some((32, 18)),
            GgmlType::IQ4_XS => Some((QK_K as u64, 136)),
            _ => None,
        }
    }

    pub fn is_supported(self) -> bool {
        self.block_layout().is_some()
    }
}

/// The f16 stored little-endian at `bytes[0..2]`.
fn f16_at(bytes: &[u8]) -> f32 {
    f16::from_le_bytes([bytes[0], bytes[1]]).to_f32()
}

/// Elements one parallel task of [`dequantize`] converts: enough that its work outweighs its
/// scheduling. A file's tensors are read in pieces of as many elements, one task each.
pub(crate) const TASK_ELEMENTS: usize = 1 << 16;

/// Dequantizes `bytes` (whole blocks of `ggml_type`) into `dtype`; `None` for a type canopy
/// does not read. The caller has checked that `bytes` holds whole blocks.
pub fn dequantize(ggml_type: GgmlType, bytes: &[u8], dtype: DType) -> Option<TypedVec> {
    let (block_elems, block_bytes) = ggml_type.block_layout()?;
    let len = bytes.len() / block_bytes as usize * block_elems as usize;
    let mut out = TypedVec::zeros(dtype, len);
    dequantize_into(ggml_type, bytes, out.slice_mut(0..len))?;
    Some(out)
}

/// Elements `first..first + out.len()` of `bytes` (whole blocks of `ggml_type`) into `out`, in
/// its dtype; `None` for a type canopy does not read. A part that starts or ends inside a
/// block decodes its covering blocks into a temporary first. The caller has checked that the
/// part lies inside `bytes`.
pub fn dequantize_part(
    ggml_type: GgmlType,
    bytes: &[u8],
    first: usize,
    mut out: TypedSliceMut,
) -> Option<()> {
    let (block_elems, block_bytes) = ggml_type.block_layout()?;
    let (block_elems, block_bytes) = (block_elems as usize, block_bytes as usize);
    let end = first + out.len();
    let (first_block, end_block) = (first / block_elems, end.div_ceil(block_elems));
    let blocks = &bytes[first_block * block_bytes..end_block * block_bytes];
    if first.is_multiple_of(block_elems) && end.is_multiple_of(block_elems) {
        return dequantize_into(ggml_type, blocks, out);
    }
    let covered = (end_block - first_block) * block_elems;
    let mut whole = TypedVec::zeros(out.dtype(), covered);
    dequantize_into(ggml_type, blocks, whole.slice_mut(0..covered))?;
    let width = out.dtype().size_bytes();
    let skip = (first - first_block * block_elems) * width;
    let len = out.len() * width;
    out.as_bytes_mut()
        .copy_from_slice(&whole.as_bytes()[skip..skip + len]);
    Some(())
}

/// Whether `ggml_type`'s stored bytes are, on this host, values of `dtype` as they are: an
/// unquantized type of the same width, little-endian.
pub(crate) fn copies_bit_for_bit(ggml_type: GgmlType, dtype: DType) -> bool {
    cfg!(target_endian = "little")
        && matches!(
            (ggml_type, dtype),
            (GgmlType::F32, DType::F32)
                | (GgmlType::F16, DType::F16)
                | (GgmlType::BF16, DType::Bf16)
        )
}

/// Dequantizes `bytes` (whole blocks of `ggml_type`, as many elements as `out` holds) into
/// `out`, in its dtype; `None` for a type canopy does not read. A model's weights are read
/// into buffers sized from their checked shapes, and reused. Large tensors are converted by
/// several threads, each its own run of blocks.
pub fn dequantize_into(ggml_type: GgmlType, bytes: &[u8], out: TypedSliceMut) -> Option<()> {
    let (block_elems, block_bytes) = ggml_type.block_layout()?;
    // A unit of decoding: a block, or QK_K elements of an unquantized type.
    let unit = if block_elems == 1 {
        (QK_K, QK_K * block_bytes as usize)
    } else {
        (block_elems as usize, block_bytes as usize)
    };
    match (ggml_type, out) {
        // Unquantized sources of the same width as the target are copied bit for bit.
        (GgmlType::F32, TypedSliceMut::F32(v)) => copy_le(bytes, v, f32::from_le_bytes),
        (GgmlType::F16, TypedSliceMut::F16(v)) => copy_le(bytes, v, f16::from_le_bytes),
        (GgmlType::BF16, TypedSliceMut::Bf16(v)) => copy_le(bytes, v, bf16::from_le_bytes),
        // f32 stores and bf16's rounding need no CPU feature: inlined a value at a time,
        // they are faster than half's slice form, which f16 takes.
        (_, TypedSliceMut::F32(v)) => decode_units(ggml_type, bytes, v, unit, |x, o| {
            for (o, &x) in o.iter_mut().zip(x) {
                *o = x;
            }
        }),
        (_, TypedSliceMut::F16(v)) => decode_units(ggml_type, bytes, v, unit, |x, o| {
            o.convert_from_f32_slice(x)
        }),
        (_, TypedSliceMut::Bf16(v)) => decode_units(ggml_type, bytes, v, unit, |x, o| {
            for (o, &x) in o.iter_mut().zip(x) {
                *o = bf16::from_f32(x);
            }
        }),
    }
    Some(())
}

/// `out.len()` values of `ggml_type` from `bytes`, decoded `unit` (elements, bytes) at a time
/// and each unit's values rounded into `out` by `convert`, a slice at once (half's f16 slice
/// conversion takes eight values an instruction where the CPU can, and checks for it once a
/// slice, not once a value); runs of whole units go to parallel tasks.
fn decode_units<T: Copy + Send>(
    ggml_type: GgmlType,
    bytes: &[u8],
    out: &mut [T],
    (unit_elems, unit_bytes): (usize, usize),
    convert: impl Fn(&[f32], &mut [T]) + Sync,
) {
    let units = (TASK_ELEMENTS / unit_elems).max(1);
    out.par_chunks_mut(units * unit_elems)
        .zip(bytes.par_chunks(units * unit_bytes))
        .for_each(|(out, bytes)| {
            let mut values = [0f32; QK_K];
            for (out, raw) in out.chunks_mut(unit_elems).zip(bytes.chunks(unit_bytes)) {
                let values = &mut values[..out.len()];
                decode_unit(ggml_type, raw, values);
                convert(values, out);
            }
        });
}

/// One unit (see [`decode_units`]) into `out`.
fn decode_unit(ggml_type: GgmlType, raw: &[u8], out: &mut [f32]) {
    match ggml_type {
        GgmlType::F32 => {
            for (x, b) in out.iter_mut().zip(raw.chunks_exact(4)) {
                *x = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        GgmlType::F16 => match bytemuck::try_cast_slice::<u8, f16>(raw) {
            // half's slice conversion takes 8 values an instruction where the CPU has F16C;
            // one value at a time, the check for it costs more than the conversion.
            Ok(values) if cfg!(target_endian = "little") && values.len() == out.len() => {
                values.convert_to_f32_slice(out)
            }
            _ => {
                for (x, b) in out.iter_mut().zip(raw.chunks_exact(2)) {
                    *x = f16::from_le_bytes([b[0], b[1]]).to_f32();
                }
            }
        },
        GgmlType::BF16 => {
            for (x, b) in out.iter_mut().zip(raw.chunks_exact(2)) {
                *x = bf16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        _ => {
            let group = code_group(ggml_type).expect("decode_unit is given a readable type");
            let mut block = BlockBuffer::new();
            let (codes, steps, offsets) = block.decode(ggml_type, raw, (out.len(), group));
            for ((out, codes), (&step, &offset)) in out
                .chunks_exact_mut(group)
                .zip(codes.chunks_exact(group))
                .zip(steps.iter().zip(offsets))
            {
                for (x, &code) in out.iter_mut().zip(codes) {
                    *x = coded_value(code, step, offset);
                }
            }
        }
    }
}

/// Elements `first..first + out.len()` of `bytes` (whole blocks of quantized `ggml_type`) as
/// codes in groups of `out.group` ([`canopy_core::coded`]), whose values are the f32 ones
/// [`dequantize_part`] gives, bit for bit. `None` for an unquantized type, or where
/// `out.group` does not divide the type's [`code_group`] or the part's ends. Runs of whole
/// blocks go to parallel tasks.
pub fn codes_part(
    ggml_type: GgmlType,
    bytes: &[u8],
    first: usize,
    out: CodedSliceMut,
) -> Option<()> {
    let native = code_group(ggml_type)?;
    let (block_elems, block_bytes) = ggml_type.block_layout()?;
    let (block_elems, block_bytes) = (block_elems as usize, block_bytes as usize);
    let group = out.group;
    if !native.is_multiple_of(group)
        || !first.is_multiple_of(group)
        || !out.len().is_multiple_of(group)
    {
        return None;
    }
    // Pieces cut at every TASK_ELEMENTS-th block boundary, each its own task.
    let task = (TASK_ELEMENTS / block_elems).max(1) * block_elems;
    cut_at_multiples(out, first, task)
        .into_par_iter()
        .for_each(|(at, piece)| {
            let mut block = BlockBuffer::new();
            let piece_end = at + piece.len();
            for b in at / block_elems..piece_end.div_ceil(block_elems) {
                let start = b * block_elems;
                let raw = &bytes[b * block_bytes..(b + 1) * block_bytes];
                let (codes, steps, offsets) = block.decode(ggml_type, raw, (block_elems, native));
                let (lo, hi) = (at.max(start), piece_end.min(start + block_elems));
                piece.codes[lo - at..hi - at].copy_from_slice(&codes[lo - start..hi - start]);
                for g in (lo - at) / group..(hi - at) / group {
                    let native_group = (at + g * group - start) / native;
                    piece.steps[g] = steps[native_group];
                    piece.offsets[g] = offsets[native_group];
                }
            }
        });
    Some(())
}

/// Reads little-endian `N`-byte values into `out`: on a little-endian host a copy, split over
/// threads (a weight is hundreds of megabytes), else a byte swap per value.
fn copy_le<T: bytemuck::Pod + Send, const N: usize>(
    bytes: &[u8],
    out: &mut [T],
    from_le: fn([u8; N]) -> T,
) {
    let task_bytes = TASK_ELEMENTS * N;
    let out_bytes: &mut [u8] = bytemuck::cast_slice_mut(out);
    out_bytes
        .par_chunks_mut(task_bytes)
        .zip(bytes.par_chunks(task_bytes))
        .for_each(|(out, bytes)| {
            if cfg!(target_endian = "little") {
                out.copy_from_slice(&bytes[..out.len()]);
            } else {
                for (out, raw) in out.chunks_exact_mut(N).zip(bytes.chunks_exact(N)) {
                    let value = from_le(raw.try_into().expect("chunks of N bytes"));
                    out.copy_from_slice(bytemuck::bytes_of(&value));
                }
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;
    use canopy_core::CodedMatrix;

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

    /// A part of a tensor, aligned to its blocks or not, decodes to the same elements as the
    /// whole: every type's block layout, with bytes whose f16 scales are finite.
    #[test]
    fn parts_decode_as_the_whole_does() {
        for ggml_type in [
            GgmlType::F32,
            GgmlType::BF16,
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q5_1,
            GgmlType::Q8_0,
            GgmlType::Q4_K,
            GgmlType::Q6_K,
            GgmlType::IQ4_XS,
        ] {
            let (block_elems, block_bytes) = ggml_type.block_layout().unwrap();
            let blocks = 3 * 256 / block_elems as usize;
            // Small bytes keep every f16 and f32 finite and small.
            let bytes: Vec<u8> = (0..blocks * block_bytes as usize)
                .map(|i| (i * 37 % 59) as u8 & 0x3b)
                .collect();
            let whole = dequantize(ggml_type, &bytes, DType::Bf16).unwrap();
            let len = whole.len();
            for (first, n) in [
                (0, len),
                (0, 1),
                (5, 300),
                (31, 2),
                (256, 256),
                (len - 7, 7),
            ] {
                let mut part = TypedVec::zeros(DType::Bf16, n);
                dequantize_part(ggml_type, &bytes, first, part.slice_mut(0..n)).unwrap();
                assert_eq!(
                    part,
                    whole.slice(first..first + n),
                    "{} at {first}",
                    ggml_type.name()
                );
            }
        }
    }

    /// Decoding into a 16-bit dtype rounds each value as `TypedVec::from_f32` rounds the f32
    /// decoding, bit for bit, for the quantized and unquantized types alike.
    #[test]
    fn sixteen_bit_decodings_round_the_f32_values() {
        for ggml_type in [GgmlType::F32, GgmlType::F16, GgmlType::Q4_K, GgmlType::Q8_0] {
            let (block_elems, block_bytes) = ggml_type.block_layout().unwrap();
            let blocks = 2 * 256 / block_elems as usize;
            let bytes: Vec<u8> = (0..blocks * block_bytes as usize)
                .map(|i| (i * 53 % 97) as u8 & 0x3b)
                .collect();
            let values = dequantize(ggml_type, &bytes, DType::F32)
                .unwrap()
                .to_f32_vec();
            for dtype in [DType::F16, DType::Bf16] {
                let decoded = dequantize(ggml_type, &bytes, dtype).unwrap();
                let rounded = TypedVec::from_f32(dtype, &values);
                assert_eq!(
                    decoded.as_bytes(),
                    rounded.as_bytes(),
                    "{} to {dtype}",
                    ggml_type.name()
                );
            }
        }
    }

    /// Every quantized type's codes, read whole or as a part that starts and ends inside
    /// blocks, in its own groups or in groups of 16, decode to the bits [`dequantize`] gives.
    #[test]
    fn codes_decode_to_the_dequantized_bits() {
        let quantized = [
            GgmlType::Q8_0,
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q5_0,
            GgmlType::Q5_1,
            GgmlType::IQ4_NL,
            GgmlType::Q2_K,
            GgmlType::Q3_K,
            GgmlType::Q4_K,
            GgmlType::Q5_K,
            GgmlType::Q6_K,
            GgmlType::IQ4_XS,
        ];
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        for ggml_type in quantized {
            let (block_elems, block_bytes) = ggml_type.block_layout().unwrap();
            let bytes: Vec<u8> = (0..3 * block_bytes)
                .map(|_| {
                    state = state
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    (state >> 56) as u8
                })
                .collect();
            let len = 3 * block_elems as usize;
            let want = dequantize(ggml_type, &bytes, DType::F32)
                .unwrap()
                .to_f32_vec();
            let native = code_group(ggml_type).unwrap();
            for (group, first, end) in [(native, 0, len), (16, 0, len), (16, 48, len - 16)] {
                let mut coded = CodedMatrix::zeros(1, end - first, group).unwrap();
                codes_part(ggml_type, &bytes, first, coded.slice_mut()).unwrap();
                let same = (coded.to_f32().iter())
                    .zip(&want[first..end])
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same,
                    "{} in groups of {group} from {first}",
                    ggml_type.name()
                );
            }
            // Groups wider than the type's are refused.
            let mut wide = CodedMatrix::zeros(1, 64, 64).unwrap();
            assert!(codes_part(ggml_type, &bytes, 0, wide.slice_mut()).is_none());
        }
        assert!(code_group(GgmlType::F32).is_none());
    }

    #[test]
    fn unknown_types_are_named_and_refused() {
        assert_eq!(GgmlType(16).name(), "IQ2_XXS");
        assert_eq!(GgmlType(4).name(), "type 4");
        assert!(dequantize(GgmlType(16), &[0; 66], DType::F32).is_none());
    }
}
