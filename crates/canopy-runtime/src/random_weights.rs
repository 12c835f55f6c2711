//! Weights drawn at random with a model's shapes, to time a model without its weights, as
//! other engines' dummy load formats do.
//!
//! Every value is a hash of the seed, the weight and its index, so any element can be made
//! again alone: the model is the same on every device, rank and thread count, and each matrix
//! is drawn on every core just before its upload.

use canopy_core::data::splitmix64;
use canopy_core::{DType, TypedSliceMut};
use canopy_model::{check_part, LlamaConfig, ModelError, WeightId, WeightSource};
use rayon::prelude::*;

/// Random weights of one model's shapes.
#[derive(Debug, Clone)]
pub struct RandomWeights {
    config: LlamaConfig,
    dtype: DType,
    seed: u64,
}

impl RandomWeights {
    /// Weights of `config`'s shapes in `dtype`, drawn from `seed`.
    pub fn new(config: &LlamaConfig, dtype: DType, seed: u64) -> RandomWeights {
        RandomWeights {
            config: config.clone(),
            dtype,
            seed,
        }
    }
}

impl WeightSource for RandomWeights {
    fn has_lm_head(&self) -> bool {
        !self.config.tie_word_embeddings
    }

    fn dtype(&self) -> DType {
        self.dtype
    }

    fn read_part(
        &self,
        id: WeightId,
        first: usize,
        mut out: TypedSliceMut,
    ) -> Result<(), ModelError> {
        let (rows, cols) = id.matrix_shape(&self.config);
        check_part(id, rows * cols, first, self.dtype, &out)?;
        let key = splitmix64(splitmix64(self.seed) ^ id.ordinal());
        let (center, half_width) = if id.is_norm() {
            (1.0, NORM_HALF_WIDTH)
        } else {
            (0.0, MATRIX_HALF_WIDTH)
        };
        random_values(&mut out, first, key, center, half_width);
        Ok(())
    }
}

/// The half-width of the uniform distribution of matrix entries: a standard deviation of
/// 0.02 (`half_width / √3`), transformers' `initializer_range` for Llama, keeps activations
/// in the range real weights give, so the timed kernels see ordinary numbers.
const MATRIX_HALF_WIDTH: f32 = 0.02 * 1.732_050_8;
/// RMSNorm weights are `1 ± 0.1`: near the identity, as trained ones mostly are.
const NORM_HALF_WIDTH: f32 = 0.1;
/// Elements per parallel task: big enough to amortize rayon's scheduling, small enough to
/// spread one matrix over every core.
const RANDOM_CHUNK: usize = 1 << 16;

/// `out`, elements `first..first + out.len()` of a weight, filled with values of
/// `center ± half_width` (uniform), elements `2j` and `2j + 1` from the two halves of one
/// hash of `(key, j)`, so any element can be regenerated alone and the result depends neither
/// on the number of threads nor on how the weight is cut into parts.
fn random_values(out: &mut TypedSliceMut, first: usize, key: u64, center: f32, half_width: f32) {
    match out {
        TypedSliceMut::F32(v) => fill_random(v, first, key, center, half_width, |x| x),
        TypedSliceMut::F16(v) => fill_random(v, first, key, center, half_width, |x| {
            bytemuck::cast(f16_bits(x))
        }),
        TypedSliceMut::Bf16(v) => fill_random(v, first, key, center, half_width, |x| {
            bytemuck::cast(bf16_bits(x))
        }),
    }
}

/// [`random_values`] with each value stored by `convert`.
fn fill_random<T: bytemuck::Pod + Send>(
    out: &mut [T],
    first: usize,
    key: u64,
    center: f32,
    half_width: f32,
    convert: impl Fn(f32) -> T + Sync,
) {
    // 24 of a half's 32 random bits to a value in (-1, 1), symmetric about 0.
    let scale = half_width / (1u32 << 23) as f32;
    let value =
        |half: u32| convert(center + (((half >> 8) as i32 - (1 << 23)) as f32 + 0.5) * scale);
    // An odd first element is the low half of its pair; the rest then starts a pair.
    let (lead, out) = out.split_at_mut((first % 2).min(out.len()));
    if let [x] = lead {
        *x = value(splitmix64(key ^ (first / 2) as u64) as u32);
    }
    let first_pair = first.div_ceil(2);
    out.par_chunks_mut(RANDOM_CHUNK)
        .enumerate()
        .for_each(|(c, chunk)| {
            // Chunks hold an even number of elements, so pair `j` never straddles two.
            let mut pairs = chunk.chunks_exact_mut(2);
            let mut j = (first_pair + c * RANDOM_CHUNK / 2) as u64;
            for pair in &mut pairs {
                let h = splitmix64(key ^ j);
                pair[0] = value((h >> 32) as u32);
                pair[1] = value(h as u32);
                j += 1;
            }
            if let [last] = pairs.into_remainder() {
                *last = value((splitmix64(key ^ j) >> 32) as u32);
            }
        });
}

/// The bits of the bf16 nearest to `x` (ties to even), which must be finite: `half`'s
/// conversion less its NaN branch, so that the generating loop stays branch-free.
fn bf16_bits(x: f32) -> u16 {
    let bits = x.to_bits();
    ((bits + 0x7fff + ((bits >> 16) & 1)) >> 16) as u16
}

/// The bits of the f16 nearest to `x` (ties to even; past 65520, infinity), which must be
/// finite: Fabian Giesen's `float_to_half_fast3_rtne`, with both paths computed and one
/// picked, so that the generating loop stays branch-free (`half` dispatches at run time for
/// each value, which takes longer than drawing it).
fn f16_bits(x: f32) -> u16 {
    let bits = x.to_bits();
    let sign = ((bits >> 16) & 0x8000) as u16;
    let abs = bits & 0x7fff_ffff;
    // Normal: rebias the exponent (127 to 15), round the 13 dropped bits to nearest even.
    let odd = (abs >> 13) & 1;
    let normal = abs.wrapping_sub(112 << 23).wrapping_add(0xfff + odd) >> 13;
    // Subnormal or zero: adding 0.5 lines the 10 mantissa bits up at the bottom of an f32,
    // rounded to nearest even by the addition itself.
    let subnormal = (f32::from_bits(abs) + 0.5)
        .to_bits()
        .wrapping_sub(0.5f32.to_bits());
    let magnitude = if abs < 0x3880_0000 { subnormal } else { normal };
    let magnitude = if abs >= 0x4780_0000 {
        0x7c00
    } else {
        magnitude
    };
    sign | magnitude as u16
}

#[cfg(test)]
mod tests {
    use super::*;
    use canopy_core::TypedVec;

    /// [`random_values`] into a new buffer.
    fn drawn(dtype: DType, len: usize, key: u64, center: f32, half_width: f32) -> TypedVec {
        let mut out = TypedVec::zeros(dtype, len);
        random_values(&mut out.slice_mut(0..len), 0, key, center, half_width);
        out
    }

    #[test]
    fn random_values_have_their_distribution() {
        let n = 1 << 18;
        let values = drawn(DType::F32, n, 3, 0.0, MATRIX_HALF_WIDTH).to_f32_vec();
        let mean = values.iter().sum::<f32>() / n as f32;
        let std = (values.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / n as f32).sqrt();
        assert!(mean.abs() < 5e-4, "mean {mean}");
        assert!((std - 0.02).abs() < 2e-4, "std {std}");
        assert!(values.iter().all(|x| x.abs() < MATRIX_HALF_WIDTH));
        let norms = drawn(DType::F32, n, 3, 1.0, NORM_HALF_WIDTH).to_f32_vec();
        assert!(norms.iter().all(|x| (0.9..=1.1).contains(x)));
        for dtype in [DType::F16, DType::Bf16] {
            let rounded = drawn(dtype, n, 3, 0.0, MATRIX_HALF_WIDTH).to_f32_vec();
            let want: Vec<f32> = values.iter().map(|&x| dtype.round(x)).collect();
            assert_eq!(rounded, want, "{dtype}");
        }
    }

    /// A part of a weight, even or odd at either end, holds the whole's elements.
    #[test]
    fn parts_draw_the_wholes_elements() {
        let len = 2 * RANDOM_CHUNK + 7;
        for dtype in DType::ALL {
            let whole = drawn(dtype, len, 9, 0.0, MATRIX_HALF_WIDTH);
            for (first, n) in [
                (1, len - 1),
                (2, 5),
                (RANDOM_CHUNK - 1, RANDOM_CHUNK + 3),
                (7, 0),
            ] {
                let mut part = TypedVec::zeros(dtype, n);
                random_values(&mut part.slice_mut(0..n), first, 9, 0.0, MATRIX_HALF_WIDTH);
                assert_eq!(
                    part,
                    whole.slice(first..first + n),
                    "{dtype}, {n} from {first}"
                );
            }
        }
    }

    /// The branch-free conversions agree bit for bit with `half`'s on finite values: normal,
    /// subnormal, ties, overflow to infinity, both signs.
    #[test]
    fn conversions_match_half() {
        let values: Vec<f32> = (0..=u32::MAX)
            .step_by(4093)
            .map(f32::from_bits)
            .chain([
                0.0,
                -0.0,
                65504.0,
                65519.99,
                65520.0,
                1e-8,
                2.0f32.powi(-25),
                1.0 + 2.0f32.powi(-11),
            ])
            .filter(|x| x.is_finite())
            .collect();
        for (dtype, ours) in [
            (DType::F16, f16_bits as fn(f32) -> u16),
            (DType::Bf16, bf16_bits),
        ] {
            let want = TypedVec::from_f32(dtype, &values);
            let want: &[u16] = bytemuck::cast_slice(want.as_bytes());
            for (x, &w) in values.iter().zip(want) {
                assert_eq!(ours(*x), w, "{dtype} of {x:e}");
            }
        }
    }
}
