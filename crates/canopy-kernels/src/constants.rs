//! Numbers the host and the kernels must agree on: descriptor layouts, flags, thread counts and
//! shared-memory tiles. Each is defined once, here or (where the planner needs it too) in
//! [`canopy_core::geometry`], and reaches every compile as an NVRTC define
//! ([`shared_defines`]); the kernel sources only check that it was given
//! (`#ifndef NAME` / `#error`), so a source compiled without the registry does not build.

pub use canopy_core::geometry::HEADS_TILE;
use canopy_core::geometry::{CTA_ROWS, HEADS_PER_CTA, HEADS_ROWS};
pub use canopy_core::geometry::{WIDE_MERGE_CTAS, WIDE_MERGE_DIMS};

/// u32 words per group descriptor: range_begin, range_count, query_begin, query_count,
/// partial_base, mask_begin + 1 (0: unmasked), tokens, flags (`decode.cu`).
pub const GROUP_WORDS: usize = 8;
/// u32 words per CTA descriptor of the tensor-core kernel: a group descriptor, the CTA's head
/// word and the group's first KV range, padded to 16-byte loads (`read_cta` in
/// `decode_mma.cu`).
pub const CTA_WORDS: usize = 12;
/// Head-word flag of a CTA on the one-warp-per-head path; the bits below it are the CTA's
/// first KV head.
pub const CTA_PER_HEAD: u32 = 1 << 16;
/// Group-descriptor flag: the tensor-core kernel loads the group's KV as first to leave L2
/// (`cp_async16` in `common.cuh`). The backend sets it where other groups read few of the
/// group's tokens.
pub const GROUP_KV_STREAMED: u32 = 1;

/// Threads per CTA of `decode_partial` (four warps).
pub const DECODE_THREADS: u32 = 128;
/// Threads per CTA of `decode_partial_mma`: four warps, one warpgroup.
pub const MMA_THREADS: u32 = 128;
/// Warps per CTA of `merge_partials`, one per (query, head).
pub const MERGE_WARPS: usize = 8;
/// Resident CTAs per SM the deep merge's registers are budgeted for (its launch bounds).
pub const DEEP_MERGE_CTAS: usize = 4;
/// Threads per CTA of `merge_partials_wide`, which walks one cell's rows with all of them.
pub const WIDE_MERGE_THREADS: usize = 256;
// `merge_partials_wide`'s threads are whole warps of whole float4 columns, and a wave of its
// CTAs fits an SM's 2048 threads.
const _: () = assert!(
    WIDE_MERGE_DIMS.is_multiple_of(4)
        && WIDE_MERGE_THREADS.is_multiple_of(32)
        && WIDE_MERGE_THREADS.is_multiple_of(WIDE_MERGE_DIMS / 4)
        && WIDE_MERGE_THREADS * WIDE_MERGE_CTAS <= 2048
);

/// `reduce_slots`' `op` argument (`combine.cu`): fold by sum, or by max.
pub const REDUCE_SUM: u32 = 0;
pub const REDUCE_MAX: u32 = 1;

/// Threads per CTA of the dense layers' kernels (`layers.cu`): the row reductions of
/// `rms_norm` and the grid-stride element-wise kernels; `causal_attention` runs one warp per
/// (query row, head), so this many over 32 per CTA.
pub const LAYER_THREADS: u32 = 256;
/// Largest head dim `causal_attention` holds (each lane keeps `head_dim / 32` elements of its
/// query and output in registers); head dims are multiples of 32 up to this.
pub const ATTENTION_MAX_HEAD_DIM: usize = 256;

/// Warps per CTA of `gemv` (`layers.cu`); the warps of one group of output columns (1, 2, 4
/// or 8, chosen per launch) share a CTA.
pub const GEMV_WARPS: u32 = 8;
/// Output columns per warp of `gemv`: the n of its m16n8k16 tensor-core products.
pub const GEMV_COLS: u32 = 8;
/// Most activation rows `gemv` multiplies at once (each lane keeps an fp32 sum per row and
/// column); a projection of more rows is a cuBLAS GEMM, as is one of more than two rows of a
/// large weight (the CUDA backend's `gemv_takes_rows`).
pub const GEMV_MAX_ROWS: usize = 8;
/// Most activation rows `gemv_normed` RMS-normalises as it reads them: each of its CTAs reads
/// the rows whole for their norms, which past a few rows costs more than the `rms_norm`
/// launch it saves.
pub const NORMED_GEMV_ROWS: usize = 2;
/// Query rows of one head each warp of `causal_attention` (`layers.cu`) attends: each key and
/// value of the block is loaded once for them.
pub const CAUSAL_ROWS: usize = 4;
/// Keys per shared-memory tile of `prefill_attention` (`prefill.cu`): eight n-tiles of scores
/// per warp, and the granularity at which a CTA skips keys none of its queries sees.
pub const PREFILL_TILE: usize = 64;
/// Shared-memory stages of `prefill_attention`'s K and V stream: one tile in flight while one
/// is computed.
pub const PREFILL_STAGES: usize = 2;
/// Rows (queries × GQA heads) per CTA of the mma.sync `prefill_attention`: 16 per warp of
/// `MMA_THREADS`. The warp-specialised kernel takes 64 per consumer warpgroup.
pub const PREFILL_ROWS: usize = MMA_THREADS as usize / 32 * 16;
/// Tiles of keys the warp-specialised `prefill_attention` (Hopper, heads of 128) takes a step:
/// its Q K^T MMAs are 128 keys wide, which the warpgroup MMA runs faster than 64.
pub const PREFILL_WS_TILES: usize = 2;
/// Shared-memory stages of the warp-specialised `prefill_attention`: its copying warpgroup
/// keeps up to this many steps of K and V tiles ahead of the consumers.
pub const PREFILL_WS_STAGES: usize = 2;
/// Warpgroups of 64 rows that compute in one CTA of the warp-specialised `prefill_attention`,
/// sharing each K and V tile; one more warpgroup copies the tiles.
pub const PREFILL_CONSUMERS: usize = 2;

/// How `prefill_attention` is launched: its threads and rows per CTA and its dynamic shared
/// memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefillLaunch {
    pub threads: u32,
    pub rows: usize,
    pub shared_bytes: usize,
}

impl PrefillLaunch {
    /// The launch of the kernel that `prefill.cu` compiles for `arch` (e.g. `sm_90a`) and
    /// `head_dim`: warp-specialised on the warpgroup MMA where `mma.cuh` sets `HAS_WGMMA`
    /// (Hopper's `sm_90a`, heads of 128), four warps on mma.sync elsewhere.
    pub fn for_device(arch: &str, head_dim: usize) -> Self {
        if arch == "sm_90a" && head_dim == 128 {
            let tile_bytes = PREFILL_TILE * head_dim * 2;
            // `WsShared`: a step's K and V tiles, four 8-byte barriers and the step's 12
            // bytes per stage, each consumer's 64 rows of Q, and 1 KB to start the tiles on
            // 1024 bytes (the 128-byte swizzle needs it).
            let stages = PREFILL_WS_STAGES * (2 * PREFILL_WS_TILES * tile_bytes + 4 * 8 + 12)
                + PREFILL_CONSUMERS * 64 * head_dim * 2;
            PrefillLaunch {
                threads: (PREFILL_CONSUMERS as u32 + 1) * 128,
                rows: PREFILL_CONSUMERS * 64,
                shared_bytes: stages + 1024,
            }
        } else {
            PrefillLaunch {
                threads: MMA_THREADS,
                rows: PREFILL_ROWS,
                shared_bytes: PREFILL_STAGES * 2 * PREFILL_TILE * (head_dim + MMA_ROW_PAD) * 2,
            }
        }
    }
}
/// Keys each thread of `top_logits` (`layers.cu`) holds in registers: a CTA narrows a
/// segment of `LAYER_THREADS · TOP_ITEMS` logits (or keys of an earlier pass) to its `k`
/// largest.
pub const TOP_ITEMS: usize = 16;
/// The largest `k` that `top_logits` takes in rounds of the CTA's largest key, one round a
/// key; a larger `k` is selected by radix, a byte of the keys a pass, which costs a few
/// rounds' time whatever `k` is.
pub const TOP_ROUNDS_MAX: usize = 8;
/// Threads of a CTA of the tail walks (`walks.cu`): the walks' passes over a row are chains of
/// fp64 exponentials, so a CTA wants many of them in flight.
pub const WALK_THREADS: u32 = 512;
/// Tokens of a walk's row one CTA of the tail walks' spread kernels takes (`walks.cu`), so that
/// one walk over a vocabulary of 128K takes 32 SMs.
pub const WALK_CHUNK: usize = 4096;
/// Bins of depth below the row's top that a `top_p` cut walk sums its masses into (`walks.cu`),
/// before it selects among the tokens of one bin.
pub const WALK_BINS: usize = 2048;
/// float4s per thread `rms_norm` keeps in registers: rows of up to `4 · LAYER_THREADS ·
/// RMS_NORM_CHUNKS` values are read once.
pub const RMS_NORM_CHUNKS: usize = 8;

/// Shared-memory stages of the one-warp-per-head path's KV pipeline.
pub const HEADS_STAGES: usize = 2;
/// Elements each shared-memory row of the tensor-core kernel's tiles is padded by (16 bytes),
/// so that ldmatrix's eight row addresses hit distinct banks.
pub const MMA_ROW_PAD: usize = 8;

/// The shared constants as NVRTC defines, added to every variant's compile.
pub fn shared_defines() -> Vec<(&'static str, String)> {
    vec![
        ("GROUP_WORDS", GROUP_WORDS.to_string()),
        ("CTA_WORDS", CTA_WORDS.to_string()),
        ("CTA_PER_HEAD", format!("{CTA_PER_HEAD:#x}u")),
        ("GROUP_KV_STREAMED", format!("{GROUP_KV_STREAMED}u")),
        ("DECODE_THREADS", DECODE_THREADS.to_string()),
        ("MMA_THREADS", MMA_THREADS.to_string()),
        ("MERGE_WARPS", MERGE_WARPS.to_string()),
        ("DEEP_MERGE_CTAS", DEEP_MERGE_CTAS.to_string()),
        ("WIDE_MERGE_THREADS", WIDE_MERGE_THREADS.to_string()),
        ("WIDE_MERGE_DIMS", WIDE_MERGE_DIMS.to_string()),
        ("WIDE_MERGE_CTAS", WIDE_MERGE_CTAS.to_string()),
        ("HEADS_TILE", HEADS_TILE.to_string()),
        ("HEADS_STAGES", HEADS_STAGES.to_string()),
        ("MMA_ROW_PAD", MMA_ROW_PAD.to_string()),
        ("CTA_ROWS", CTA_ROWS.to_string()),
        ("HEADS_ROWS", HEADS_ROWS.to_string()),
        ("HEADS_PER_CTA", HEADS_PER_CTA.to_string()),
        ("LAYER_THREADS", LAYER_THREADS.to_string()),
        ("ATTENTION_MAX_HEAD_DIM", ATTENTION_MAX_HEAD_DIM.to_string()),
        ("GEMV_WARPS", GEMV_WARPS.to_string()),
        ("GEMV_COLS", GEMV_COLS.to_string()),
        ("GEMV_MAX_ROWS", GEMV_MAX_ROWS.to_string()),
        ("CAUSAL_ROWS", CAUSAL_ROWS.to_string()),
        ("RMS_NORM_CHUNKS", RMS_NORM_CHUNKS.to_string()),
        ("TOP_ITEMS", TOP_ITEMS.to_string()),
        ("TOP_ROUNDS_MAX", TOP_ROUNDS_MAX.to_string()),
        ("WALK_THREADS", WALK_THREADS.to_string()),
        ("WALK_CHUNK", WALK_CHUNK.to_string()),
        ("WALK_BINS", WALK_BINS.to_string()),
        ("PREFILL_TILE", PREFILL_TILE.to_string()),
        ("PREFILL_STAGES", PREFILL_STAGES.to_string()),
        ("PREFILL_WS_STAGES", PREFILL_WS_STAGES.to_string()),
        ("PREFILL_CONSUMERS", PREFILL_CONSUMERS.to_string()),
        ("PREFILL_WS_TILES", PREFILL_WS_TILES.to_string()),
        ("REDUCE_SUM", REDUCE_SUM.to_string()),
        ("REDUCE_MAX", REDUCE_MAX.to_string()),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both launches fit an SM (Hopper's 227 KB of shared memory a CTA) and hold every GQA
    /// group the host sends to `prefill.cu` (up to `PREFILL_ROWS` heads a KV head).
    #[test]
    fn prefill_launches_fit_an_sm_and_a_gqa_group() {
        for (arch, head_dim) in [
            ("sm_90a", 128),
            ("sm_90a", 64),
            ("sm_89", 128),
            ("sm_80", 64),
        ] {
            let launch = PrefillLaunch::for_device(arch, head_dim);
            assert!(
                launch.shared_bytes <= 227 * 1024,
                "{arch} {head_dim}: {launch:?}"
            );
            assert!(launch.threads <= 1024 && launch.threads.is_multiple_of(128));
            assert!(launch.rows >= PREFILL_ROWS && launch.rows.is_multiple_of(16));
        }
        let hopper = PrefillLaunch::for_device("sm_90a", 128);
        assert_eq!(hopper.threads, 128 * (PREFILL_CONSUMERS as u32 + 1));
        assert_eq!(hopper.rows, 64 * PREFILL_CONSUMERS);
        assert_eq!(PrefillLaunch::for_device("sm_90a", 64).threads, MMA_THREADS);
    }
}
