// Products of a few activation rows with a 16-bit weight: more rows than `gemv` takes
// (layers.cu) and at most GEMM_MAX_ROWS, as a serving pass's decode rows are. Such a product is
// bound by the weight's bytes, which cuBLAS streamed at about 82% of the copy bandwidth at 64
// rows (BENCHMARKS, session 26); this kernel is built to stream them as `gemv` does.
//
// - Each weight row is read once, by one warp, straight into registers as the B operand of
//   m16n8k16 tensor-core products: 16-byte loads that skip L1, issued two chunks of k ahead of
//   the products that use them, with no shared memory between DRAM and the tensor cores.
// - The activation rows, rounded to the weight's dtype by the op that wrote them, are what
//   every weight row meets: a CTA stages them in shared memory a chunk of k at a time
//   (cp.async, GEMM_STAGES stages in flight) for the GEMM_TILE weight rows of its warps, whose
//   A fragments are read from there. One barrier a chunk frees the stage the next copy fills.
// - Within each 64-element block of k, lane q's two 16-byte loads of a weight row are elements
//   [8q, 8q + 8) and [32 + 8q, 40 + 8q): each load instruction of a warp reads whole 32-byte
//   sectors, and the eight 32-bit words a lane holds are its B fragments of the block's four
//   products as loaded. A dot product does not depend on the order of k, so the A fragments
//   are read from the staged rows with the same numbering, and neither operand is unpacked.
// - A CTA has GEMM_WARPS_N x GEMM_WARPS_K warps: the tile's rows are split GEMM_WARPS_N ways
//   (16 rows a warp) and each chunk's k GEMM_WARPS_K ways (one block a warp); the k-warps' sums
//   meet in shared memory.
// - Where the tiles alone do not fill the GPU, a cluster of `splits` CTAs (at most 8) splits k
//   and adds its partial tiles through distributed shared memory, in rank order: no partial
//   sum goes to global memory, and the result does not depend on timing.
//
// The epilogue is the output's: `gemm_rows` stores fp32, `gemm_rows_add` adds into the output
// (a residual connection), `gemm_rows_swiglu` takes a fused gate|up weight (2 cols rows) and
// stores silu(gate) * up, in fp32 or, where the host gives `out_narrow`, rounded to the
// weight's dtype (the rounded copy a GEMM operand holds).

#ifndef GEMM_WARPS_N
#error "GEMM_WARPS_N must be defined by the kernel registry"
#endif
#ifndef GEMM_WARPS_K
#error "GEMM_WARPS_K must be defined by the kernel registry"
#endif
#ifndef GEMM_MAX_ROWS
#error "GEMM_MAX_ROWS must be defined by the kernel registry"
#endif
#ifndef GEMM_PHASE
#error "GEMM_PHASE must be defined by the kernel registry"
#endif
#if CANOPY_DTYPE == 0
#error "gemm.cu multiplies 16-bit weights on the tensor cores"
#endif

#define GEMM_THREADS (GEMM_WARPS_N * GEMM_WARPS_K * 32)
#define GEMM_BLOCK 64
#define GEMM_TILE (16 * GEMM_WARPS_N)
#define GEMM_MTILES (GEMM_MAX_ROWS / 16)
// Blocks of k each warp takes in a phase: the k-warps take them in turn.
#define GEMM_PHASE_BLOCKS (GEMM_PHASE / GEMM_BLOCK / GEMM_WARPS_K)
// Staged rows are 64 bytes apart modulo 128, so the eight lanes of a quarter-warp (two rows,
// four 16-byte pieces each) read distinct banks.
#define GEMM_LD (GEMM_PHASE + 32)
// The CTA's partial tile (rows x GEMM_TILE fp32), padded, reuses the staged rows' memory. The
// host gives the CTA the larger of the two as dynamic shared memory (`gemm_shared_bytes`).
#define GEMM_RED_LD (GEMM_TILE + 4)
#define GEMM_PIECES (GEMM_PHASE / 8)

enum GemmOut { GEMM_STORE, GEMM_ADD, GEMM_SWIGLU };

// A lane's two 16-byte pieces of one weight row's block at k0 (zeros from `end` on, or for a
// row outside the weight).
__device__ __forceinline__ void gemm_load_row(const elem_t* __restrict__ row, bool live, u32 end, u32 k0,
                                              uint4 (&b)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const u32 e = k0 + h * 32 + (threadIdx.x % 4) * 8;
        b[h] = live && e < end ? load_streamed(reinterpret_cast<const uint4*>(row + e)) : make_uint4(0u, 0u, 0u, 0u);
    }
}

// The warp's block at k0, for both its groups of 8 weight rows.
__device__ __forceinline__ void gemm_load_block(const elem_t* const (&rows)[2], const bool (&live)[2], u32 end,
                                                u32 k0, uint4 (&b)[2][2]) {
#pragma unroll
    for (int g = 0; g < 2; ++g) gemm_load_row(rows[g], live[g], end, k0, b[g]);
}

// x's first `staged` rows over [p, p + GEMM_PHASE) into shared memory (zeros past `rows` and
// from `end` on), then a barrier: thread t copies piece t % GEMM_PIECES of rows
// t / GEMM_PIECES, t / GEMM_PIECES + GEMM_THREADS / GEMM_PIECES, ...
__device__ __forceinline__ void gemm_stage_x(const elem_t* __restrict__ x, u32 rows, u32 staged, u32 k, u32 end, u32 p,
                                             elem_t* smem) {
    const u32 piece = threadIdx.x % GEMM_PIECES, e = p + piece * 8;
    const elem_t* src = x + (u64)(threadIdx.x / GEMM_PIECES) * k + e;
    for (u32 m = threadIdx.x / GEMM_PIECES; m < staged; m += GEMM_THREADS / GEMM_PIECES) {
        const bool live = m < rows && e < end;
        cp_async16(smem + m * GEMM_LD + piece * 8, live ? src : x, live ? 16u : 0u, false);
        src += (u64)(GEMM_THREADS / GEMM_PIECES) * k;
    }
    cp_async_commit();
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
    __syncthreads();
}

// acc += the staged rows' columns [c, c + 64) times the warp's weight block.
__device__ __forceinline__ void gemm_block(float (&acc)[GEMM_MTILES][2][4], const elem_t* smem, u32 c, u32 mtiles,
                                           const uint4 (&b)[2][2]) {
    const u32 lane = threadIdx.x % 32;
    const elem_t* xb = smem + (lane / 4) * GEMM_LD + c + (lane % 4) * 8;
#pragma unroll
    for (int mt = 0; mt < GEMM_MTILES; ++mt) {
        if ((u32)mt >= mtiles) break;
        const elem_t* r0 = xb + mt * 16 * GEMM_LD;
        const elem_t* r1 = r0 + 8 * GEMM_LD;
        const uint4 p[4] = {*reinterpret_cast<const uint4*>(r0), *reinterpret_cast<const uint4*>(r0 + 32),
                            *reinterpret_cast<const uint4*>(r1), *reinterpret_cast<const uint4*>(r1 + 32)};
        const u32 lo[8] = {p[0].x, p[0].y, p[0].z, p[0].w, p[1].x, p[1].y, p[1].z, p[1].w};
        const u32 hi[8] = {p[2].x, p[2].y, p[2].z, p[2].w, p[3].x, p[3].y, p[3].z, p[3].w};
#pragma unroll
        for (int g = 0; g < 2; ++g) {
            const u32 w[8] = {b[g][0].x, b[g][0].y, b[g][0].z, b[g][0].w, b[g][1].x, b[g][1].y, b[g][1].z, b[g][1].w};
#pragma unroll
            for (int t = 0; t < 4; ++t) {
                const u32 a[4] = {lo[2 * t], hi[2 * t], lo[2 * t + 1], hi[2 * t + 1]};
                mma16816(acc[mt][g], a, w[2 * t], w[2 * t + 1]);
            }
        }
    }
}

// What a warp streams: its weight rows and the CTA's k range [begin, end).
struct GemmStream {
    const elem_t* rows[2];
    bool live[2];
    u32 begin, end;
#ifdef GEMM_PROBE_PREFETCH
    const elem_t* prow;
    bool prow_live;
#endif
};

// k of the warp's i-th block: phase i / GEMM_PHASE_BLOCKS, the warp's (i % GEMM_PHASE_BLOCKS)-th
// block of it (the k-warps' blocks alternate, so they read one run of each row together).
__device__ __forceinline__ u32 gemm_block_k(const GemmStream& s, u32 i) {
    const u32 wk = threadIdx.x / 32 / GEMM_WARPS_N;
    return s.begin + (i / GEMM_PHASE_BLOCKS) * GEMM_PHASE + ((i % GEMM_PHASE_BLOCKS) * GEMM_WARPS_K + wk) * GEMM_BLOCK;
}

// The warp's i-th block (of n): at a phase's first block, the CTA stages the phase's rows
// (after every warp is done with the last phase's); then the block two on is loaded into
// `ahead` (the registers block i - 1 used) and this one's product taken from `cur`.
__device__ __forceinline__ void gemm_step(float (&acc)[GEMM_MTILES][2][4], const GemmStream& s,
                                          const elem_t* __restrict__ x, elem_t* smem, u32 rows, u32 staged,
                                          u32 mtiles, u32 k, u32 i, u32 n, const uint4 (&cur)[2][2],
                                          uint4 (&ahead)[2][2]) {
#ifdef GEMM_PROBE_NO_X
    if (i == 0) {
#else
    if (i % GEMM_PHASE_BLOCKS == 0) {
#endif
        if (i > 0) __syncthreads();
        gemm_stage_x(x, rows, staged, k, s.end, s.begin + (i / GEMM_PHASE_BLOCKS) * GEMM_PHASE, smem);
#ifdef GEMM_PROBE_PREFETCH
        // Probe: the next GEMM_PROBE_PREFETCH phases of the thread's tile row into L2, one request.
        if (threadIdx.x < GEMM_TILE) {
            const u32 from = s.begin + (i / GEMM_PHASE_BLOCKS + 1) * GEMM_PHASE;
            const u32 to = min(from + GEMM_PROBE_PREFETCH * GEMM_PHASE, s.end);
            if (from < to && s.prow_live)
                asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(s.prow + from), "r"((to - from) * 2)
                             : "memory");
        }
#endif
    }
    if (i + 2 < n) gemm_load_block(s.rows, s.live, s.end, gemm_block_k(s, i + 2), ahead);
#ifdef GEMM_PROBE_NO_MMA
    acc[0][0][0] += __uint_as_float(cur[0][0].x ^ cur[0][1].y ^ cur[1][0].z ^ cur[1][1].w) * 1e-30f;
#else
    gemm_block(acc, smem, (gemm_block_k(s, i) - s.begin) % GEMM_PHASE, mtiles, cur);
#endif
}

__device__ __forceinline__ u32 cluster_rank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// The float at `p` in the shared memory of the cluster's CTA `rank`.
__device__ __forceinline__ float load_cluster(const float* p, u32 rank) {
    u32 a = (u32)__cvta_generic_to_shared(p), remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(a), "r"(rank));
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
    return v;
}

template <int OUT>
__device__ __forceinline__ void gemm_rows_cta(const elem_t* __restrict__ w, const elem_t* __restrict__ x,
                                              float* __restrict__ out, elem_t* __restrict__ out_narrow, u32 rows,
                                              u32 cols, u32 k, u32 splits) {
    extern __shared__ __align__(16) unsigned char gemm_smem[];
    elem_t* smem = reinterpret_cast<elem_t*>(gemm_smem);
    const u32 lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const u32 wn = warp % GEMM_WARPS_N, wk = warp / GEMM_WARPS_N;
    const u32 tile = blockIdx.x / splits, split = blockIdx.x % splits;
    const u32 mtiles = (rows + 15) / 16, staged = mtiles * 16;
    // SwiGLU's tile is half gate rows, half the matching up rows; its output is half as wide.
    const u32 tile_cols = OUT == GEMM_SWIGLU ? GEMM_TILE / 2 : GEMM_TILE;
    // The split's k range, in whole blocks of the k-warps.
    const u32 unit = GEMM_BLOCK * GEMM_WARPS_K, units = (k + unit - 1) / unit, per = (units + splits - 1) / splits;
    GemmStream s;
    s.begin = min(split * per * unit, k);
    s.end = min(s.begin + per * unit, k);
    const u32 phases = (s.end - s.begin + GEMM_PHASE - 1) / GEMM_PHASE, n = phases * GEMM_PHASE_BLOCKS;
#pragma unroll
    for (int g = 0; g < 2; ++g) {
        const u32 l = wn * 16 + g * 8 + lane / 4;
        const u32 c = tile * tile_cols + l % tile_cols;
        const u32 row = OUT == GEMM_SWIGLU && l >= tile_cols ? cols + c : c;
        s.live[g] = c < cols;
        s.rows[g] = w + (u64)(s.live[g] ? row : 0) * k;
    }
#ifdef GEMM_PROBE_PREFETCH
    {
        const u32 l = threadIdx.x % GEMM_TILE, c = tile * tile_cols + l % tile_cols;
        s.prow_live = c < cols;
        s.prow = w + (u64)(s.prow_live ? (OUT == GEMM_SWIGLU && l >= tile_cols ? cols + c : c) : 0) * k;
        if (threadIdx.x < GEMM_TILE && s.prow_live && s.begin < s.end)
            asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(s.prow + s.begin),
                         "r"((min(s.begin + GEMM_PHASE, s.end) - s.begin) * 2) : "memory");
    }
#endif
    let_next_grid_launch();
    // The first two blocks of the weight, which is no kernel's output, before the wait.
    uint4 b0[2][2], b1[2][2], b2[2][2];
    if (n > 0) gemm_load_block(s.rows, s.live, s.end, gemm_block_k(s, 0), b0);
    if (n > 1) gemm_load_block(s.rows, s.live, s.end, gemm_block_k(s, 1), b1);
    wait_for_previous_grid();

    float acc[GEMM_MTILES][2][4] = {};
    for (u32 i = 0; i < n; i += 3) {
        gemm_step(acc, s, x, smem, rows, staged, mtiles, k, i, n, b0, b2);
        if (i + 1 < n) gemm_step(acc, s, x, smem, rows, staged, mtiles, k, i + 1, n, b1, b0);
        if (i + 2 < n) gemm_step(acc, s, x, smem, rows, staged, mtiles, k, i + 2, n, b2, b1);
    }
    __syncthreads();

    // The k-warps' sums, added in k-warp order into the CTA's partial tile.
    float* red = reinterpret_cast<float*>(gemm_smem);
    for (int half = GEMM_WARPS_K - 1; half >= 0; --half) {
        if (wk == (u32)half)
#pragma unroll
            for (int mt = 0; mt < GEMM_MTILES; ++mt) {
                if ((u32)mt >= mtiles) break;
#pragma unroll
                for (int g = 0; g < 2; ++g)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const u32 m = mt * 16 + lane / 4 + (e / 2) * 8, l = wn * 16 + g * 8 + 2 * (lane % 4) + e % 2;
                        float& slot = red[m * GEMM_RED_LD + l];
                        slot = half == GEMM_WARPS_K - 1 ? acc[mt][g][e] : slot + acc[mt][g][e];
                    }
            }
        __syncthreads();
    }

    // The cluster's partial tiles, added in rank order; each CTA finishes a share of the
    // outputs. The second barrier keeps every CTA's shared memory alive until all have read it.
    if (splits > 1) cluster_sync();
    const u32 rank = splits > 1 ? cluster_rank() : 0;
    const u32 total = rows * tile_cols, share = (total + splits - 1) / splits;
    const u32 last = min(total, (rank + 1) * share);
    for (u32 i = rank * share + threadIdx.x; i < last; i += GEMM_THREADS) {
        const u32 m = i / tile_cols, c = i % tile_cols, n = tile * tile_cols + c;
        if (n >= cols) continue;
        float s = 0.f, up = 0.f;
        for (u32 r = 0; r < splits; ++r) {
            const float* p = red + m * GEMM_RED_LD + c;
            s += splits > 1 ? load_cluster(p, r) : *p;
            if (OUT == GEMM_SWIGLU) up += splits > 1 ? load_cluster(p + tile_cols, r) : p[tile_cols];
        }
        const u64 at = (u64)m * cols + n;
        if (OUT == GEMM_STORE) out[at] = s;
        if (OUT == GEMM_ADD) out[at] += s;
        if (OUT == GEMM_SWIGLU) {
            const float y = silu_mul(s, up);
            if (out_narrow) out_narrow[at] = narrow(y);
            else out[at] = y;
        }
    }
    if (splits > 1) cluster_sync();
}

// Each launches tiles x splits CTAs of GEMM_THREADS threads, clusters of `splits` (1, 2, 4 or
// 8) along x: weight rows [GEMM_TILE t, GEMM_TILE (t + 1)) for tile t (for SwiGLU, gate's and
// up's rows of output columns [GEMM_TILE t / 2, GEMM_TILE (t + 1) / 2)). rows <= GEMM_MAX_ROWS;
// k is a whole number of 16-byte pieces.
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 2)
gemm_rows(const elem_t* __restrict__ w, const elem_t* __restrict__ x, float* __restrict__ out, u32 rows, u32 cols,
          u32 k, u32 splits) {
    gemm_rows_cta<GEMM_STORE>(w, x, out, nullptr, rows, cols, k, splits);
}

extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 2)
gemm_rows_add(const elem_t* __restrict__ w, const elem_t* __restrict__ x, float* __restrict__ out, u32 rows,
              u32 cols, u32 k, u32 splits) {
    gemm_rows_cta<GEMM_ADD>(w, x, out, nullptr, rows, cols, k, splits);
}

// `cols` is the output's width: the weight has 2 cols rows, gate's then up's. Exactly one of
// `out` and `out_narrow` is written (the other may be null).
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 2)
gemm_rows_swiglu(const elem_t* __restrict__ w, const elem_t* __restrict__ x, float* __restrict__ out,
                 elem_t* __restrict__ out_narrow, u32 rows, u32 cols, u32 k, u32 splits) {
    gemm_rows_cta<GEMM_SWIGLU>(w, x, out, out_narrow, rows, cols, k, splits);
}
