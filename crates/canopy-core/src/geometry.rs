//! How canopy's tensor-core kernels cut a plan into CTAs. The CUDA backend launches by these
//! numbers and `auto`'s [`crate::DeviceModel`] prices plans by them, so they live here, once.

/// Query rows (queries × GQA rows) one CTA of the many-row kernel holds; larger groups are
/// split by query.
pub const CTA_ROWS: usize = 64;
/// Groups of at most this many rows run one warp per KV head (one m16 tile per warp).
pub const HEADS_ROWS: usize = 16;
/// KV heads per CTA of the one-warp-per-head kernel (one per warp).
pub const HEADS_PER_CTA: usize = 4;
/// Shortest piece a long group is split into to fill the GPU: below this, partials and
/// launch costs dominate.
pub const MIN_SPLIT_TOKENS: u32 = 256;

/// Whether a group of `rows` query rows runs on the one-warp-per-head kernel.
pub fn runs_per_head(rows: usize, kv_heads: usize) -> bool {
    kv_heads.is_multiple_of(HEADS_PER_CTA) && rows <= HEADS_ROWS
}
