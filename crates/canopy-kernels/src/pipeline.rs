//! The tensor-core kernel's build parameters (head dimensions and KV pipelines) and the
//! shared memory they need.

use crate::constants::{HEADS_STAGES, HEADS_TILE, MMA_ROW_PAD, MMA_THREADS};
pub use canopy_core::geometry::MMA_HEAD_DIMS;
use canopy_core::geometry::{CTA_ROWS, HEADS_PER_CTA};

/// Tokens per shared-memory KV tile of the tensor-core kernel (`TILE` in `decode_mma.cu`).
pub const MMA_TILES: [usize; 2] = [32, 64];
/// Shared-memory stages of the tensor-core kernel's KV pipeline (`STAGES` in `decode_mma.cu`).
pub const MMA_STAGES: [usize; 3] = [2, 3, 4];

/// How the many-row tensor-core kernel streams KV through shared memory. The one-warp-per-head
/// kernel is compiled into the same module (its own pipeline is fixed), so the fields are that
/// module's defines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MmaPipeline {
    /// Tokens per tile of `decode_partial_mma`.
    pub tile: usize,
    /// Its stages: `stages - 1` tiles are in flight while one is computed.
    pub stages: usize,
}

impl Default for MmaPipeline {
    /// Measured on FastTree's trees on H100 (docs/BENCHMARKS.md, session 6): 32-token tiles
    /// four deep beat 64-token tiles two deep (the same shared memory) on 17 of 20
    /// configurations.
    fn default() -> Self {
        MmaPipeline {
            tile: 32,
            stages: 4,
        }
    }
}

impl MmaPipeline {
    /// The NVRTC defines of the module beside the element type and head dimension.
    pub fn defines(&self) -> [(&'static str, String); 2] {
        [
            ("TILE", self.tile.to_string()),
            ("STAGES", self.stages.to_string()),
        ]
    }

    /// Whether the kernel source is written for this tile and stage count.
    pub fn is_supported(&self) -> bool {
        MMA_TILES.contains(&self.tile) && MMA_STAGES.contains(&self.stages)
    }
    /// Dynamic shared memory of `decode_partial_mma` for `head_dim` in this pipeline: the
    /// largest of its paths' needs. The many-row path's stages of K and V tiles (`Stage`: 16-bit
    /// rows padded by [`MMA_ROW_PAD`] elements), or the merge scratch that reuses them
    /// (`Scratch`) if that is larger; the one-warp-per-head path's stages of
    /// [`HEADS_PER_CTA`] heads' tiles (`HeadStage`).
    pub fn shared_bytes(&self, head_dim: usize) -> usize {
        let row = (head_dim + MMA_ROW_PAD) * 2;
        let stages = self.stages * 2 * self.tile * row;
        // Per warp, in f32: m and l of its 16 rows (one m16 tile), a weight per CTA row, and
        // its 16 rows of O.
        let warps = MMA_THREADS as usize / 32;
        let scratch = warps * (2 * 16 + CTA_ROWS + 16 * head_dim) * 4;
        let heads = HEADS_STAGES * 2 * HEADS_PER_CTA * HEADS_TILE * row;
        stages.max(scratch).max(heads)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The sizes of the kernel's shared-memory structs for the head dims and pipelines it is
    /// built for.
    #[test]
    fn shared_bytes_of_each_path() {
        let p = |tile, stages| MmaPipeline { tile, stages };
        // Four 32-token stages and the one-warp-per-head path's two tie.
        assert_eq!(MmaPipeline::default().shared_bytes(128), 69632);
        assert_eq!(MmaPipeline::default().shared_bytes(64), 36864);
        assert_eq!(p(64, 4).shared_bytes(128), 139264);
        // Two 32-token stages: the one-warp-per-head path's need.
        assert_eq!(p(32, 2).shared_bytes(64), 36864);
    }
}
