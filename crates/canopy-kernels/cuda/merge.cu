// Stage 2 of decoding: partial states to one state per query, following the plan's CSR map.
// Two kernels: `merge_partials`, one warp per cell (query, head), for merges of many cells, and
// `merge_partials_wide` (at the end), a CTA per cell, for few cells of many rows each.
//
// merge_partials: one warp per (query, head), MERGE_WARPS per CTA. Lane i holds the query's
// i-th partial row (its index and lse) so that the max and the sum of weights are two warp
// reductions; then every lane folds its own head_dim / 32 output elements over the rows in CSR
// order (no atomics, so the result is bit-for-bit reproducible). The row indices and weights
// come from the lanes that hold them by shuffle, so the loads of the rows' outputs do not
// depend on one another. A query with no rows gets the empty partial (o = 0, lse = -inf), from
// either kernel.
//
// Both are launched as programmatic dependents of stage 1: they read the CSR map, which stage 1
// does not write, before `wait_for_previous_grid`. Both let the kernel after them launch at
// once (it waits for them in turn).
//
// Each has a `_rounded` twin that also writes each output rounded to the 16-bit type of code
// `rounded_dtype` into `rounded` (queries x heads x head_dim, as out_o): the operand of the
// output projection's GEMM, with no kernel of its own to round it. The twins are entries of
// their own, so the plain merges compile as they did without them: one kernel that branched on
// `rounded` made FastTree's tree 4 4% slower in `bench tree` (BENCHMARKS, session 64).

#ifndef MERGE_WARPS
#error "MERGE_WARPS must be defined by the kernel registry"
#endif
// Rows' output loads a lane keeps in flight. The host builds a deeper variant for merges of few
// cells (a few queries over a long prefix cut into many pieces), where each warp's walk over
// its rows is a chain of memory latencies; it needs 64 registers, so half as many warps fit,
// which slowed the merges of thousands of queries (BENCHMARKS, session 9).
#ifndef MERGE_DEPTH
#error "MERGE_DEPTH must be defined by the kernel registry"
#endif
#ifndef DEEP_MERGE_CTAS
#error "DEEP_MERGE_CTAS must be defined by the kernel registry"
#endif
#if MERGE_DEPTH > 4
#define MERGE_MIN_CTAS DEEP_MERGE_CTAS
#else
#define MERGE_MIN_CTAS 1
#endif

template <bool Rounded>
__device__ __forceinline__ void merge_cells(const float* __restrict__ po, const float* __restrict__ plse,
                                            const u32* __restrict__ query_ptr, const u32* __restrict__ query_rows,
                                            float* __restrict__ out_o, float* __restrict__ out_lse, u32 queries,
                                            int q_heads, int head_dim, u16* __restrict__ rounded, u32 rounded_dtype) {
    let_next_grid_launch();
    const int lane = threadIdx.x % 32;
    const u64 cell = (u64)blockIdx.x * MERGE_WARPS + threadIdx.x / 32;
    if (cell >= (u64)queries * q_heads) return;
    const u32 qi = (u32)(cell / q_heads);
    const int h = (int)(cell % q_heads);
    const u32 b = query_ptr[qi], e = query_ptr[qi + 1];
    u32 my_row = 0;
    if (b + lane < e) my_row = query_rows[b + lane];
    wait_for_previous_grid();

    // Partials are read once: they leave L2 first (see `l2_policy`).
    float my_lse = NEG_INF;
    if (b + lane < e) my_lse = load_dropped(plse + (u64)my_row * q_heads + h, l2_policy(false));
    float M = my_lse;
    for (u32 i = b + 32 + lane; i < e; i += 32)
        M = fmaxf(M, load_dropped(plse + (u64)query_rows[i] * q_heads + h, l2_policy(false)));
#pragma unroll
    for (int o = 16; o > 0; o /= 2) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
    const float my_w = M == NEG_INF ? 0.f : __expf(my_lse - M);
    float L = my_w;
    for (u32 i = b + 32 + lane; i < e; i += 32)
        L += __expf(load_dropped(plse + (u64)query_rows[i] * q_heads + h, l2_policy(false)) - M);
#pragma unroll
    for (int o = 16; o > 0; o /= 2) L += __shfl_xor_sync(0xffffffffu, L, o);

    const u64 out = cell * head_dim;
    // Every lane runs every pass (the shuffles need the whole warp); 64-wide heads leave half
    // the lanes without elements.
    for (int pass = 0; pass * 128 < head_dim; ++pass) {
        const int d0 = pass * 128 + lane * 4;
        const bool mine = d0 < head_dim;
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        for (u32 c = b; c < e; c += 32) {
            // Rows c .. c + 31: lane j holds row c + j and its weight.
            u32 row = my_row;
            float w = my_w;
            if (c != b) {
                row = c + lane < e ? query_rows[c + lane] : 0u;
                w = c + lane < e ? __expf(load_dropped(plse + (u64)row * q_heads + h, l2_policy(false)) - M) : 0.f;
            }
            const u32 n = min(32u, e - c);
#pragma unroll MERGE_DEPTH
            for (u32 j = 0; j < n; ++j) {
                const u64 r = (u64)__shfl_sync(0xffffffffu, row, j) * q_heads + h;
                const float wj = __shfl_sync(0xffffffffu, w, j);
                if (mine) {
                    const float4 x = load_dropped(reinterpret_cast<const float4*>(po + r * head_dim + d0), l2_policy(false));
                    acc.x = fmaf(x.x, wj, acc.x);
                    acc.y = fmaf(x.y, wj, acc.y);
                    acc.z = fmaf(x.z, wj, acc.z);
                    acc.w = fmaf(x.w, wj, acc.w);
                }
            }
        }
        if (mine) {
            const float inv = L > 0.f ? 1.f / L : 0.f;
            acc.x *= inv; acc.y *= inv; acc.z *= inv; acc.w *= inv;
            *reinterpret_cast<float4*>(out_o + out + d0) = acc;
            if (Rounded) store_rounded4(rounded + out + d0, acc, rounded_dtype);
        }
    }
    if (lane == 0) out_lse[cell] = L > 0.f ? M + __logf(L) : NEG_INF;
}

extern "C" __global__ void __launch_bounds__(MERGE_WARPS * 32, MERGE_MIN_CTAS)
merge_partials(const float* __restrict__ po, const float* __restrict__ plse,
               const u32* __restrict__ query_ptr, const u32* __restrict__ query_rows,
               float* __restrict__ out_o, float* __restrict__ out_lse, u32 queries, int q_heads,
               int head_dim) {
    merge_cells<false>(po, plse, query_ptr, query_rows, out_o, out_lse, queries, q_heads, head_dim, nullptr, 0);
}

extern "C" __global__ void __launch_bounds__(MERGE_WARPS * 32, MERGE_MIN_CTAS)
merge_partials_rounded(const float* __restrict__ po, const float* __restrict__ plse,
                       const u32* __restrict__ query_ptr, const u32* __restrict__ query_rows,
                       float* __restrict__ out_o, float* __restrict__ out_lse, u32 queries, int q_heads,
                       int head_dim, u16* __restrict__ rounded, u32 rounded_dtype) {
    merge_cells<true>(po, plse, query_ptr, query_rows, out_o, out_lse, queries, q_heads, head_dim, rounded,
                      rounded_dtype);
}

// merge_partials_wide: merges of few cells with many rows each (one query over a long context
// cut into a hundred pieces or more), where merge_partials' warps would each walk hundreds of
// rows in a chain of dependent loads. One CTA of WIDE_MERGE_THREADS per (query, head, block of
// WIDE_MERGE_DIMS output elements). Thread t takes float4 column t % COLS of the block over rows
// t / COLS, t / COLS + SLICES, ... of the cell's CSR list: the first WIDE_ROWS of them are loaded
// (lse and output) at once, as soon as stage 1 has finished, and held in registers while the CTA
// finds the cell's max lse; rows past those (more than WIDE_ROWS * SLICES) are read in a loop.
// The slices' sums are then added in slice order and the weights' sum is a fixed tree, so the
// result is bit-for-bit reproducible (no atomics); the fold order differs from merge_partials',
// within rounding. Every CTA of a cell computes the cell's max and weights itself: a few hundred
// 4-byte loads, cheaper than a second pass.
#ifndef WIDE_MERGE_THREADS
#error "WIDE_MERGE_THREADS must be defined by the kernel registry"
#endif
#ifndef WIDE_MERGE_DIMS
#error "WIDE_MERGE_DIMS must be defined by the kernel registry"
#endif
// Resident CTAs per SM its registers are budgeted for; the host runs it where its grid fits in
// one wave of them.
#ifndef WIDE_MERGE_CTAS
#error "WIDE_MERGE_CTAS must be defined by the kernel registry"
#endif
#define WIDE_COLS (WIDE_MERGE_DIMS / 4)
#define WIDE_SLICES (WIDE_MERGE_THREADS / WIDE_COLS)
#define WIDE_WARPS (WIDE_MERGE_THREADS / 32)
#define WIDE_ROWS 8  // rows per thread held in registers

// `x` reduced over the CTA (max, or sum) in a fixed order; every thread gets the result.
// `scratch` holds one float per warp; the CTA is synchronised on return.
template <bool Max>
__device__ __forceinline__ float cta_reduce(float x, float* scratch) {
#pragma unroll
    for (int o = 16; o > 0; o /= 2) {
        const float y = __shfl_xor_sync(0xffffffffu, x, o);
        x = Max ? fmaxf(x, y) : x + y;
    }
    if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = x;
    __syncthreads();
    x = scratch[0];
#pragma unroll
    for (int w = 1; w < WIDE_WARPS; ++w) x = Max ? fmaxf(x, scratch[w]) : x + scratch[w];
    __syncthreads();
    return x;
}

__device__ __forceinline__ void fold4(float4& acc, const float4& x, float w) {
    acc.x = fmaf(x.x, w, acc.x);
    acc.y = fmaf(x.y, w, acc.y);
    acc.z = fmaf(x.z, w, acc.z);
    acc.w = fmaf(x.w, w, acc.w);
}

template <bool Rounded>
__device__ __forceinline__ void merge_wide(const float* __restrict__ po, const float* __restrict__ plse,
                                           const u32* __restrict__ query_ptr, const u32* __restrict__ query_rows,
                                           float* __restrict__ out_o, float* __restrict__ out_lse, u32 queries,
                                           int q_heads, int head_dim, u16* __restrict__ rounded, u32 rounded_dtype) {
    let_next_grid_launch();
    __shared__ float reduce[WIDE_WARPS];
    __shared__ float4 slices[WIDE_SLICES][WIDE_COLS];
    const int blocks = head_dim / WIDE_MERGE_DIMS;
    const u64 cell = blockIdx.x / blocks;
    const int col = threadIdx.x % WIDE_COLS;
    const int d0 = (int)(blockIdx.x % blocks) * WIDE_MERGE_DIMS + col * 4;
    const u32 slice = threadIdx.x / WIDE_COLS;
    if (cell >= (u64)queries * q_heads) return;
    const u32 qi = (u32)(cell / q_heads);
    const int h = (int)(cell % q_heads);
    const u32 b = query_ptr[qi], n = query_ptr[qi + 1] - b;
    u32 row[WIDE_ROWS];
#pragma unroll
    for (int k = 0; k < WIDE_ROWS; ++k) {
        const u32 j = slice + k * WIDE_SLICES;
        row[k] = j < n ? query_rows[b + j] : 0u;
    }
    wait_for_previous_grid();

    // Partials are read once: they leave L2 first (see `l2_policy`).
    const u64 policy = l2_policy(false);
    float lse[WIDE_ROWS];
    float4 x[WIDE_ROWS];
#pragma unroll
    for (int k = 0; k < WIDE_ROWS; ++k) {
        const bool mine = slice + k * WIDE_SLICES < n;
        const u64 r = (u64)row[k] * q_heads + h;
        lse[k] = mine ? load_dropped(plse + r, policy) : NEG_INF;
        x[k] = mine ? load_dropped(reinterpret_cast<const float4*>(po + r * head_dim + d0), policy)
                    : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    float M = NEG_INF;
#pragma unroll
    for (int k = 0; k < WIDE_ROWS; ++k) M = fmaxf(M, lse[k]);
    for (u32 j = slice + WIDE_ROWS * WIDE_SLICES; j < n; j += WIDE_SLICES)
        M = fmaxf(M, load_dropped(plse + (u64)query_rows[b + j] * q_heads + h, policy));
    M = cta_reduce<true>(M, reduce);

    // A cell whose rows are all empty has M = -inf: every weight is 0.
    const float base = M == NEG_INF ? 0.f : M;
    float L = 0.f;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int k = 0; k < WIDE_ROWS; ++k) {
        const float w = __expf(lse[k] - base);
        L += w;
        fold4(acc, x[k], w);
    }
#pragma unroll 4
    for (u32 j = slice + WIDE_ROWS * WIDE_SLICES; j < n; j += WIDE_SLICES) {
        const u64 r = (u64)query_rows[b + j] * q_heads + h;
        const float w = __expf(load_dropped(plse + r, policy) - base);
        L += w;
        fold4(acc, load_dropped(reinterpret_cast<const float4*>(po + r * head_dim + d0), policy), w);
    }
    // Each row's weight is counted by the thread of column 0 of its slice.
    L = cta_reduce<false>(col == 0 ? L : 0.f, reduce);
    slices[slice][col] = acc;
    __syncthreads();
    if (slice == 0) {
        for (int s = 1; s < WIDE_SLICES; ++s) {
            const float4 y = slices[s][col];
            acc.x += y.x; acc.y += y.y; acc.z += y.z; acc.w += y.w;
        }
        const float inv = L > 0.f ? 1.f / L : 0.f;
        acc.x *= inv; acc.y *= inv; acc.z *= inv; acc.w *= inv;
        *reinterpret_cast<float4*>(out_o + cell * head_dim + d0) = acc;
        if (Rounded) store_rounded4(rounded + cell * head_dim + d0, acc, rounded_dtype);
        if (d0 == 0) out_lse[cell] = L > 0.f ? M + __logf(L) : NEG_INF;
    }
}

extern "C" __global__ void __launch_bounds__(WIDE_MERGE_THREADS, WIDE_MERGE_CTAS)
merge_partials_wide(const float* __restrict__ po, const float* __restrict__ plse,
                    const u32* __restrict__ query_ptr, const u32* __restrict__ query_rows,
                    float* __restrict__ out_o, float* __restrict__ out_lse, u32 queries, int q_heads,
                    int head_dim) {
    merge_wide<false>(po, plse, query_ptr, query_rows, out_o, out_lse, queries, q_heads, head_dim, nullptr, 0);
}

extern "C" __global__ void __launch_bounds__(WIDE_MERGE_THREADS, WIDE_MERGE_CTAS)
merge_partials_wide_rounded(const float* __restrict__ po, const float* __restrict__ plse,
                            const u32* __restrict__ query_ptr, const u32* __restrict__ query_rows,
                            float* __restrict__ out_o, float* __restrict__ out_lse, u32 queries, int q_heads,
                            int head_dim, u16* __restrict__ rounded, u32 rounded_dtype) {
    merge_wide<true>(po, plse, query_ptr, query_rows, out_o, out_lse, queries, q_heads, head_dim, rounded,
                     rounded_dtype);
}
