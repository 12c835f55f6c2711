// Stage 2 of decoding: partial states to one state per query, following the plan's CSR map.
//
// One warp per (query, head), MERGE_WARPS per CTA. Lane i holds the query's i-th partial row
// (its index and lse) so that the max and the sum of weights are two warp reductions; then
// every lane folds its own head_dim / 32 output elements over the rows in CSR order (no
// atomics, so the result is bit-for-bit reproducible). The row indices and weights come from the lanes
// that hold them by shuffle, so the loads of the rows' outputs do not depend on one another.
// A query with no rows gets the empty partial (o = 0, lse = -inf).
//
// It is launched as a programmatic dependent of stage 1: it reads the CSR map, which stage 1
// does not write, before `wait_for_previous_grid`.

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

extern "C" __global__ void __launch_bounds__(MERGE_WARPS * 32, MERGE_MIN_CTAS)
merge_partials(const float* __restrict__ po, const float* __restrict__ plse,
               const u32* __restrict__ query_ptr, const u32* __restrict__ query_rows,
               float* __restrict__ out_o, float* __restrict__ out_lse, u32 queries, int q_heads,
               int head_dim) {
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
        }
    }
    if (lane == 0) out_lse[cell] = L > 0.f ? M + __logf(L) : NEG_INF;
}
