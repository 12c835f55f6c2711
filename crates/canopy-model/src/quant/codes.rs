//! Each quantized block as codes, with a step and an offset per group (see
//! [`canopy_core::coded`]): the one decoding of every quantized type, from which both a
//! weight's f32 values and its coded form come.
//!
//! Each type's element is written the way ggml's `dequantize_row_*` computes it, as
//! `code · step + offset` in f32: `step · code - offset` is that with the offset negated, and
//! a type with no offset takes `-0.0`, which adds nothing.

use super::{f16_at, GgmlType, QK_K};
use canopy_core::CodedSliceMut;

/// The smallest group of any type: a K-quant's sub-block of 16.
pub(super) const MIN_GROUP: usize = 16;
/// The offset of a type whose elements are `code · step` alone.
const NO_OFFSET: f32 = -0.0;

/// Elements that share a step and an offset in `ggml_type`: its block for the 32-element
/// types, its sub-block for the K-quants and IQ4_XS; `None` for an unquantized type.
pub fn code_group(ggml_type: GgmlType) -> Option<usize> {
    match ggml_type {
        GgmlType::Q8_0
        | GgmlType::Q4_0
        | GgmlType::Q4_1
        | GgmlType::Q5_0
        | GgmlType::Q5_1
        | GgmlType::IQ4_NL
        | GgmlType::Q4_K
        | GgmlType::Q5_K
        | GgmlType::IQ4_XS => Some(32),
        GgmlType::Q2_K | GgmlType::Q3_K | GgmlType::Q6_K => Some(16),
        _ => None,
    }
}

/// One block of quantized `ggml_type` into `out`, which covers the block's elements in groups
/// of [`code_group`].
pub(super) fn block_codes(ggml_type: GgmlType, raw: &[u8], out: CodedSliceMut) {
    debug_assert_eq!(Some(out.group), code_group(ggml_type));
    match ggml_type {
        GgmlType::Q2_K => q2_k(raw, out),
        GgmlType::Q3_K => q3_k(raw, out),
        GgmlType::Q4_K | GgmlType::Q5_K => q45_k(ggml_type == GgmlType::Q5_K, raw, out),
        GgmlType::Q6_K => q6_k(raw, out),
        GgmlType::IQ4_XS => iq4_xs(raw, out),
        _ => block_32(ggml_type, raw, out),
    }
}

/// One block of a 32-element type (the table of the module above).
fn block_32(ggml_type: GgmlType, raw: &[u8], out: CodedSliceMut) {
    out.steps[0] = f16_at(raw);
    out.offsets[0] = NO_OFFSET;
    let codes = out.codes;
    match ggml_type {
        GgmlType::Q8_0 => {
            for (c, &q) in codes.iter_mut().zip(&raw[2..]) {
                *c = q as i8;
            }
        }
        GgmlType::Q4_0 => unpack_nibbles(&raw[2..], codes, |q, _| q as i8 - 8),
        GgmlType::Q4_1 => {
            out.offsets[0] = f16_at(&raw[2..]);
            unpack_nibbles(&raw[4..], codes, |q, _| q as i8);
        }
        GgmlType::Q5_0 => {
            let high = u32::from_le_bytes([raw[2], raw[3], raw[4], raw[5]]);
            unpack_nibbles(&raw[6..], codes, |q, i| (q | fifth_bit(high, i)) as i8 - 16);
        }
        GgmlType::Q5_1 => {
            out.offsets[0] = f16_at(&raw[2..]);
            let high = u32::from_le_bytes([raw[4], raw[5], raw[6], raw[7]]);
            unpack_nibbles(&raw[8..], codes, |q, i| (q | fifth_bit(high, i)) as i8);
        }
        GgmlType::IQ4_NL => unpack_nibbles(&raw[2..], codes, |q, _| IQ4_VALUES[q as usize]),
        _ => unreachable!("block_32 is called for the 32-element types only"),
    }
}

/// The 16 values a 4-bit index of IQ4_NL and IQ4_XS stands for (ggml's `kvalues_iq4nl`): a
/// non-uniform grid, denser near zero, that a block's scale multiplies.
const IQ4_VALUES: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// Bit `i` of a Q5 block's fifth bits, as the value 16 or 0.
fn fifth_bit(high: u32, i: usize) -> u8 {
    (((high >> i) & 1) << 4) as u8
}

/// Elements 0..16 are the low nibbles of the 16 bytes, elements 16..32 the high nibbles;
/// `code` gets each nibble and its element's index.
fn unpack_nibbles(packed: &[u8], block: &mut [i8], code: impl Fn(u8, usize) -> i8) {
    let (low, high) = block.split_at_mut(16);
    for (j, ((lo, hi), &byte)) in low.iter_mut().zip(high.iter_mut()).zip(packed).enumerate() {
        *lo = code(byte & 0x0f, j);
        *hi = code(byte >> 4, j + 16);
    }
}

/// Q2_K and Q3_K order their 2-bit values the same way: element `128 h + 32 j + 16 p + l`
/// (`h < 2`, `j < 4`, `p < 2`, `l < 16`) is bits `2 j` of value byte `32 h + 16 p + l`, in
/// sub-block `8 h + 2 j + p`. `sub_block(sub-block, 4 h + j)` gives the sub-block's step and
/// offset, and the code of a 2-bit value and its value byte's index modulo 32.
fn for_each_2bit<F: Fn(u8, usize) -> i8>(
    values: &[u8],
    out: CodedSliceMut,
    sub_block: impl Fn(usize, usize) -> (f32, f32, F),
) {
    for (s, sub_codes) in out.codes.chunks_exact_mut(16).enumerate() {
        let (h, j, p) = (s / 8, s / 2 % 4, s % 2);
        let (step, offset, code) = sub_block(8 * h + 2 * j + p, 4 * h + j);
        (out.steps[s], out.offsets[s]) = (step, offset);
        for (l, c) in sub_codes.iter_mut().enumerate() {
            let byte = 32 * h + 16 * p + l;
            *c = code((values[byte] >> (2 * j)) & 3, byte % 32);
        }
    }
}

/// Q2_K: `step · q - offset`, both from a sub-block's scale byte (low nibble scale, high
/// nibble minimum).
fn q2_k(raw: &[u8], out: CodedSliceMut) {
    let (scales, values) = (&raw[..16], &raw[16..80]);
    let (d, dmin) = (f16_at(&raw[80..]), f16_at(&raw[82..]));
    for_each_2bit(values, out, |sub, _| {
        let step = d * f32::from(scales[sub] & 0x0f);
        let offset = dmin * f32::from(scales[sub] >> 4);
        (step, -offset, |q, _| q as i8)
    });
}

/// Q3_K: `step · (q - 4)`, or `step · q` where the value's mask bit is set.
fn q3_k(raw: &[u8], out: CodedSliceMut) {
    let (masks, values, packed) = (&raw[..32], &raw[32..96], &raw[96..108]);
    let d = f16_at(&raw[108..]);
    // Scale i: its low four bits are a nibble of byte i % 8 (the low one for i < 8), its high
    // two are bits 2 (i / 4) of byte 8 + i % 4; stored offset by 32.
    let scale = |i: usize| {
        let low = if i < 8 {
            packed[i] & 0x0f
        } else {
            packed[i - 8] >> 4
        };
        let high = (packed[8 + i % 4] >> (2 * (i / 4))) & 3;
        f32::from(low | high << 4) - 32.0
    };
    for_each_2bit(values, out, |sub, plane| {
        // A clear bit `plane` of the value's mask byte takes 4 off the value.
        let code = move |q: u8, byte: usize| {
            let high = (masks[byte] >> plane) & 1;
            q as i8 - if high == 1 { 0 } else { 4 }
        };
        (d * scale(sub), NO_OFFSET, code)
    });
}

/// Q4_K and Q5_K: element `64 c + 32 k + l` (`c < 4`, `k < 2`, `l < 32`) is the low (`k = 0`)
/// or high nibble of byte `32 c + l`, in sub-block `2 c + k`; for Q5_K, bit `2 c + k` of fifth-bit
/// byte `l` adds 16. The element is `step · q - offset`.
fn q45_k(fifth_bits: bool, raw: &[u8], out: CodedSliceMut) {
    let (d, dmin) = (f16_at(raw), f16_at(&raw[2..]));
    let packed = &raw[4..16];
    let (high, nibbles) = if fifth_bits {
        (&raw[16..48], &raw[48..176])
    } else {
        (&raw[..0], &raw[16..144])
    };
    // Sub-block i's 6-bit scale and minimum: bytes i and i + 4 for i < 4; else a nibble of
    // byte i + 4 and the top two bits of bytes i - 4 and i.
    let scale_min = |i: usize| {
        if i < 4 {
            (packed[i] & 63, packed[i + 4] & 63)
        } else {
            (
                (packed[i + 4] & 0x0f) | (packed[i - 4] >> 6) << 4,
                (packed[i + 4] >> 4) | (packed[i] >> 6) << 4,
            )
        }
    };
    for (sub, sub_codes) in out.codes.chunks_exact_mut(32).enumerate() {
        let (c, k) = (sub / 2, sub % 2);
        let (scale, min) = scale_min(sub);
        out.steps[sub] = d * f32::from(scale);
        out.offsets[sub] = -(dmin * f32::from(min));
        for (l, code) in sub_codes.iter_mut().enumerate() {
            let mut q = (nibbles[32 * c + l] >> (4 * k)) & 0x0f;
            if fifth_bits {
                q |= ((high[l] >> sub) & 1) << 4;
            }
            *code = q as i8;
        }
    }
}

/// IQ4_XS: `d`, two bytes of the sub-blocks' scales' high bits, four of their low nibbles, then
/// eight sub-blocks of 32 in IQ4_NL's nibble order. Sub-block `b`'s 6-bit scale is nibble
/// `b % 2` of byte `b / 2` below bits `2 b` of the high bits, stored offset by 32.
fn iq4_xs(raw: &[u8], out: CodedSliceMut) {
    let d = f16_at(raw);
    let high = u16::from_le_bytes([raw[2], raw[3]]);
    let (low, nibbles) = (&raw[4..8], &raw[8..136]);
    for (b, sub) in out.codes.chunks_exact_mut(32).enumerate() {
        let scale = ((low[b / 2] >> (4 * (b % 2))) & 0x0f) | (((high >> (2 * b)) & 3) as u8) << 4;
        out.steps[b] = d * (f32::from(scale) - 32.0);
        out.offsets[b] = NO_OFFSET;
        unpack_nibbles(&nibbles[16 * b..16 * (b + 1)], sub, |q, _| {
            IQ4_VALUES[q as usize]
        });
    }
}

/// Q6_K: element `128 h + 32 k + l` (`h < 2`, `k < 4`, `l < 32`) has its low four bits from
/// nibble `k / 2` of byte `64 h + 32 (k % 2) + l`, its high two from bits `2 k` of byte
/// `32 h + l` of the pairs, and scale `8 h + 2 k + l / 16`; stored offset by 32.
fn q6_k(raw: &[u8], out: CodedSliceMut) {
    let (low, pairs, scales) = (&raw[..128], &raw[128..192], &raw[192..208]);
    let d = f16_at(&raw[208..]);
    for (s, sub_codes) in out.codes.chunks_exact_mut(16).enumerate() {
        let (h, k, half) = (s / 8, s / 2 % 4, s % 2);
        out.steps[s] = d * f32::from(scales[8 * h + 2 * k + half] as i8);
        out.offsets[s] = NO_OFFSET;
        for (i, code) in sub_codes.iter_mut().enumerate() {
            let l = 16 * half + i;
            let nibble = (low[64 * h + 32 * (k % 2) + l] >> (4 * (k / 2))) & 0x0f;
            let q = nibble | ((pairs[32 * h + l] >> (2 * k)) & 3) << 4;
            *code = q as i8 - 32;
        }
    }
}

/// Codes of one block at a time, in its own groups, for copying into parts cut elsewhere.
pub(super) struct BlockBuffer {
    codes: [i8; QK_K],
    steps: [f32; QK_K / MIN_GROUP],
    offsets: [f32; QK_K / MIN_GROUP],
}

impl BlockBuffer {
    pub(super) fn new() -> Self {
        BlockBuffer {
            codes: [0; QK_K],
            steps: [0.0; QK_K / MIN_GROUP],
            offsets: [0.0; QK_K / MIN_GROUP],
        }
    }

    /// Decodes a block of `elements` elements in groups of `group`, and returns its parts.
    pub(super) fn decode(
        &mut self,
        ggml_type: GgmlType,
        raw: &[u8],
        (elements, group): (usize, usize),
    ) -> (&[i8], &[f32], &[f32]) {
        let groups = elements / group;
        block_codes(
            ggml_type,
            raw,
            CodedSliceMut {
                group,
                codes: &mut self.codes[..elements],
                steps: &mut self.steps[..groups],
                offsets: &mut self.offsets[..groups],
            },
        );
        (
            &self.codes[..elements],
            &self.steps[..groups],
            &self.offsets[..groups],
        )
    }
}
