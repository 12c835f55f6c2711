//! KV storage element types. Storage may be 16-bit; arithmetic is always fp32 (or f64 in the
//! oracle), so every element type only needs a lossless widening to `f32`.

use half::{bf16, f16};
use serde::{Deserialize, Serialize};

/// The element type KV (and queries) are stored in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F32,
    F16,
    Bf16,
}

impl DType {
    pub const ALL: [DType; 3] = [DType::F32, DType::F16, DType::Bf16];

    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::Bf16 => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
        }
    }

    /// Rounds an `f32` to the nearest value this type can store, so that random inputs can be
    /// drawn once and given identically to every backend and to the f64 oracle.
    pub fn round(self, x: f32) -> f32 {
        match self {
            DType::F32 => x,
            DType::F16 => f16::from_f32(x).to_f32(),
            DType::Bf16 => bf16::from_f32(x).to_f32(),
        }
    }
}

impl std::str::FromStr for DType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "fp32" | "float32" => Ok(DType::F32),
            "f16" | "fp16" | "float16" | "half" => Ok(DType::F16),
            "bf16" | "bfloat16" => Ok(DType::Bf16),
            other => Err(format!("unknown dtype `{other}`; use f32, f16 or bf16")),
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A storable KV element: plain old data with a widening conversion.
pub trait KvElement: bytemuck::Pod + Send + Sync + 'static {
    const DTYPE: DType;
    fn to_f32(self) -> f32;
    fn from_f32(x: f32) -> Self;
    /// The elements as f32 where they are f32 already, so a reader need not widen a copy.
    fn as_f32(_elements: &[Self]) -> Option<&[f32]> {
        None
    }
}

impl KvElement for f32 {
    const DTYPE: DType = DType::F32;
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(x: f32) -> Self {
        x
    }
    fn as_f32(elements: &[f32]) -> Option<&[f32]> {
        Some(elements)
    }
}

impl KvElement for f16 {
    const DTYPE: DType = DType::F16;
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
}

impl KvElement for bf16 {
    const DTYPE: DType = DType::Bf16;
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
}

/// Elements of a [`TypedVec`], borrowed to be written in place.
#[derive(Debug)]
pub enum TypedSliceMut<'a> {
    F32(&'a mut [f32]),
    F16(&'a mut [f16]),
    Bf16(&'a mut [bf16]),
}

impl TypedSliceMut<'_> {
    pub fn dtype(&self) -> DType {
        match self {
            TypedSliceMut::F32(_) => DType::F32,
            TypedSliceMut::F16(_) => DType::F16,
            TypedSliceMut::Bf16(_) => DType::Bf16,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            TypedSliceMut::F32(v) => v.len(),
            TypedSliceMut::F16(v) => v.len(),
            TypedSliceMut::Bf16(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The elements' bytes, in the host's order, to be written in place.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        match self {
            TypedSliceMut::F32(v) => bytemuck::cast_slice_mut(v),
            TypedSliceMut::F16(v) => bytemuck::cast_slice_mut(v),
            TypedSliceMut::Bf16(v) => bytemuck::cast_slice_mut(v),
        }
    }
}

impl<'a> TypedSliceMut<'a> {
    /// `bytes` as elements of `dtype`, to be written in place: memory that is not a typed
    /// vector's (a device's page-locked upload buffer). `None` where `bytes` is not a whole
    /// number of elements, or not aligned for them.
    pub fn from_bytes_mut(dtype: DType, bytes: &'a mut [u8]) -> Option<TypedSliceMut<'a>> {
        Some(match dtype {
            DType::F32 => TypedSliceMut::F32(bytemuck::try_cast_slice_mut(bytes).ok()?),
            DType::F16 => TypedSliceMut::F16(bytemuck::try_cast_slice_mut(bytes).ok()?),
            DType::Bf16 => TypedSliceMut::Bf16(bytemuck::try_cast_slice_mut(bytes).ok()?),
        })
    }

    /// The elements before `mid`, and those from it on: parts written by different readers.
    /// Panics if `mid > self.len()`, as `split_at_mut` does.
    pub fn split_at_mut(self, mid: usize) -> (TypedSliceMut<'a>, TypedSliceMut<'a>) {
        match self {
            TypedSliceMut::F32(v) => {
                let (a, b) = v.split_at_mut(mid);
                (TypedSliceMut::F32(a), TypedSliceMut::F32(b))
            }
            TypedSliceMut::F16(v) => {
                let (a, b) = v.split_at_mut(mid);
                (TypedSliceMut::F16(a), TypedSliceMut::F16(b))
            }
            TypedSliceMut::Bf16(v) => {
                let (a, b) = v.split_at_mut(mid);
                (TypedSliceMut::Bf16(a), TypedSliceMut::Bf16(b))
            }
        }
    }
}

/// Owned, typed storage for one tensor of KV elements.
#[derive(Debug, Clone, PartialEq)]
pub enum TypedVec {
    F32(Vec<f32>),
    F16(Vec<f16>),
    Bf16(Vec<bf16>),
}

impl TypedVec {
    /// Stores `values` (already representable in `dtype`, or rounded here) as `dtype`.
    pub fn from_f32(dtype: DType, values: &[f32]) -> Self {
        match dtype {
            DType::F32 => TypedVec::F32(values.to_vec()),
            DType::F16 => TypedVec::F16(values.iter().map(|&x| f16::from_f32(x)).collect()),
            DType::Bf16 => TypedVec::Bf16(values.iter().map(|&x| bf16::from_f32(x)).collect()),
        }
    }

    pub fn zeros(dtype: DType, len: usize) -> Self {
        match dtype {
            DType::F32 => TypedVec::F32(vec![0.0; len]),
            DType::F16 => TypedVec::F16(vec![f16::ZERO; len]),
            DType::Bf16 => TypedVec::Bf16(vec![bf16::ZERO; len]),
        }
    }

    pub fn dtype(&self) -> DType {
        match self {
            TypedVec::F32(_) => DType::F32,
            TypedVec::F16(_) => DType::F16,
            TypedVec::Bf16(_) => DType::Bf16,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            TypedVec::F32(v) => v.len(),
            TypedVec::F16(v) => v.len(),
            TypedVec::Bf16(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The raw bytes, e.g. for sending KV blocks between ranks or uploading to a device.
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            TypedVec::F32(v) => bytemuck::cast_slice(v),
            TypedVec::F16(v) => bytemuck::cast_slice(v),
            TypedVec::Bf16(v) => bytemuck::cast_slice(v),
        }
    }

    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        match self {
            TypedVec::F32(v) => bytemuck::cast_slice_mut(v),
            TypedVec::F16(v) => bytemuck::cast_slice_mut(v),
            TypedVec::Bf16(v) => bytemuck::cast_slice_mut(v),
        }
    }

    /// Copies `src` (same dtype) into `self[offset..]`.
    pub fn copy_from(&mut self, offset: usize, src: &TypedVec) {
        let width = self.dtype().size_bytes();
        let bytes = src.as_bytes();
        self.as_bytes_mut()[offset * width..offset * width + bytes.len()].copy_from_slice(bytes);
    }

    /// Elements `range`, to be written in place.
    pub fn slice_mut(&mut self, range: std::ops::Range<usize>) -> TypedSliceMut<'_> {
        match self {
            TypedVec::F32(v) => TypedSliceMut::F32(&mut v[range]),
            TypedVec::F16(v) => TypedSliceMut::F16(&mut v[range]),
            TypedVec::Bf16(v) => TypedSliceMut::Bf16(&mut v[range]),
        }
    }

    /// Makes this `len` elements of `dtype`, keeping the allocation where the dtype stays: a
    /// buffer reused for data of many sizes. The elements kept hold what they held.
    pub fn resize(&mut self, dtype: DType, len: usize) {
        match self {
            TypedVec::F32(v) if dtype == DType::F32 => v.resize(len, 0.0),
            TypedVec::F16(v) if dtype == DType::F16 => v.resize(len, f16::ZERO),
            TypedVec::Bf16(v) if dtype == DType::Bf16 => v.resize(len, bf16::ZERO),
            _ => *self = TypedVec::zeros(dtype, len),
        }
    }

    /// A copy of elements `range`.
    pub fn slice(&self, range: std::ops::Range<usize>) -> TypedVec {
        match self {
            TypedVec::F32(v) => TypedVec::F32(v[range].to_vec()),
            TypedVec::F16(v) => TypedVec::F16(v[range].to_vec()),
            TypedVec::Bf16(v) => TypedVec::Bf16(v[range].to_vec()),
        }
    }

    pub fn to_f32_vec(&self) -> Vec<f32> {
        match self {
            TypedVec::F32(v) => v.clone(),
            TypedVec::F16(v) => v.iter().map(|x| x.to_f32()).collect(),
            TypedVec::Bf16(v) => v.iter().map(|x| x.to_f32()).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_views_and_splits_write_the_elements_they_cover() {
        for dtype in DType::ALL {
            let mut v = TypedVec::zeros(dtype, 6);
            let bytes = v.as_bytes_mut();
            let width = dtype.size_bytes();
            let view = TypedSliceMut::from_bytes_mut(dtype, &mut bytes[width..]).unwrap();
            let (mut a, mut b) = view.split_at_mut(2);
            assert_eq!((a.len(), b.len()), (2, 3), "{dtype}");
            a.as_bytes_mut()
                .copy_from_slice(TypedVec::from_f32(dtype, &[1.0, 2.0]).as_bytes());
            b.as_bytes_mut()
                .copy_from_slice(TypedVec::from_f32(dtype, &[3.0, 4.0, 5.0]).as_bytes());
            assert_eq!(v.to_f32_vec(), [0.0, 1.0, 2.0, 3.0, 4.0, 5.0], "{dtype}");
            let mut odd = vec![0u8; 4 * width + 1];
            assert!(
                TypedSliceMut::from_bytes_mut(dtype, &mut odd).is_none(),
                "{dtype}"
            );
        }
    }

    #[test]
    fn rounding_matches_storage() {
        for dtype in DType::ALL {
            let x = 0.123_456_79_f32;
            let stored = TypedVec::from_f32(dtype, &[x]).to_f32_vec()[0];
            assert_eq!(stored, dtype.round(x), "{dtype}");
        }
        assert_ne!(DType::Bf16.round(0.123_456_79), 0.123_456_79);
    }

    #[test]
    fn parses_names() {
        assert_eq!("BF16".parse::<DType>().unwrap(), DType::Bf16);
        assert!("int8".parse::<DType>().unwrap_err().contains("use f32"));
    }

    #[test]
    fn copy_from_places_elements() {
        let mut dst = TypedVec::zeros(DType::Bf16, 6);
        dst.copy_from(2, &TypedVec::from_f32(DType::Bf16, &[1.0, 2.0]));
        assert_eq!(dst.to_f32_vec(), vec![0.0, 0.0, 1.0, 2.0, 0.0, 0.0]);
    }
}
