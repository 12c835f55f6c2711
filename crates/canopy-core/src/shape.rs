//! The attention shape shared by every layer of the stack.

use crate::error::{CoreError, Result};
use serde::{Deserialize, Serialize};

/// Head dimensions the kernels are written for.
pub const SUPPORTED_HEAD_DIMS: [usize; 3] = [64, 128, 256];

/// Query heads, KV heads (GQA when fewer than query heads), head dimension and softmax scale.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AttnShape {
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Softmax scale applied to `q . k`; `None` means `1 / sqrt(head_dim)`.
    #[serde(default)]
    pub scale: Option<f32>,
}

impl AttnShape {
    /// Checks the shape; every constructor path goes through here.
    pub fn new(q_heads: usize, kv_heads: usize, head_dim: usize) -> Result<Self> {
        let shape = AttnShape {
            q_heads,
            kv_heads,
            head_dim,
            scale: None,
        };
        shape.validate()?;
        Ok(shape)
    }

    pub fn validate(&self) -> Result<()> {
        if self.q_heads == 0 || self.kv_heads == 0 {
            return Err(CoreError::Shape(format!(
                "heads must be positive (got {} query heads, {} KV heads)",
                self.q_heads, self.kv_heads
            )));
        }
        if !self.q_heads.is_multiple_of(self.kv_heads) {
            return Err(CoreError::Shape(format!(
                "query heads ({}) must be a multiple of KV heads ({}) for grouped-query attention",
                self.q_heads, self.kv_heads
            )));
        }
        if !SUPPORTED_HEAD_DIMS.contains(&self.head_dim) {
            return Err(CoreError::Shape(format!(
                "head dim {} is not supported; use one of {:?}",
                self.head_dim, SUPPORTED_HEAD_DIMS
            )));
        }
        if let Some(scale) = self.scale {
            if !scale.is_finite() || scale <= 0.0 {
                return Err(CoreError::Shape(format!(
                    "softmax scale must be positive and finite, got {scale}"
                )));
            }
        }
        Ok(())
    }

    /// Query heads per KV head.
    pub fn group_size(&self) -> usize {
        self.q_heads / self.kv_heads
    }

    pub fn softmax_scale(&self) -> f32 {
        self.scale.unwrap_or(1.0 / (self.head_dim as f32).sqrt())
    }

    /// Elements of one token's K (or V) over all KV heads.
    pub fn kv_token_elems(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Bytes of one token's K (or V) over all KV heads, stored as `dtype`.
    pub fn kv_token_bytes(&self, dtype: crate::DType) -> usize {
        self.kv_token_elems() * dtype.size_bytes()
    }

    /// Elements of one query row over all query heads.
    pub fn q_row_elems(&self) -> usize {
        self.q_heads * self.head_dim
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_bad_shapes() {
        assert!(AttnShape::new(32, 8, 128).is_ok());
        assert!(AttnShape::new(0, 8, 128)
            .unwrap_err()
            .to_string()
            .contains("positive"));
        assert!(AttnShape::new(30, 8, 128)
            .unwrap_err()
            .to_string()
            .contains("multiple"));
        assert!(AttnShape::new(8, 8, 96)
            .unwrap_err()
            .to_string()
            .contains("not supported"));
    }

    #[test]
    fn default_scale_is_inverse_sqrt_dim() {
        let s = AttnShape::new(4, 2, 64).unwrap();
        assert_eq!(s.softmax_scale(), 0.125);
        assert_eq!(s.group_size(), 2);
    }
}
