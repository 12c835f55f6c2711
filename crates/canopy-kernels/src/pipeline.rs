//! The tensor-core kernel's build parameters: head dimensions and KV pipelines.

/// Head dimensions the tensor-core kernel is built for (its accumulators for 256 would not fit
/// in registers beside the score tile).
pub const MMA_HEAD_DIMS: [usize; 2] = [64, 128];
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
}
