// Stage 2 of decoding: partial states to one state per query, following the plan's CSR map.
//
// One warp per (query, head), eight per CTA: the lanes find the max and the sum of the query's
// partial lse values together, then each lane folds its own head_dim / 32 output elements over
// the rows, in CSR order (no atomics, so the result is bit-for-bit reproducible). A query with
// no rows gets the empty partial (o = 0, lse = -inf); a query with one row is a copy.

#define MERGE_WARPS 8

extern "C" __global__ void __launch_bounds__(MERGE_WARPS * 32)
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
    float M = NEG_INF;
    for (u32 i = b + lane; i < e; i += 32) M = fmaxf(M, plse[(u64)query_rows[i] * q_heads + h]);
#pragma unroll
    for (int o = 16; o > 0; o /= 2) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
    float L = 0.f;
    if (M != NEG_INF)
        for (u32 i = b + lane; i < e; i += 32) L += __expf(plse[(u64)query_rows[i] * q_heads + h] - M);
#pragma unroll
    for (int o = 16; o > 0; o /= 2) L += __shfl_xor_sync(0xffffffffu, L, o);
    const u64 out = cell * head_dim;
    for (int d0 = lane * 4; d0 < head_dim; d0 += 128) {
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        if (L > 0.f) {
            for (u32 i = b; i < e; ++i) {
                const u64 row = (u64)query_rows[i] * q_heads + h;
                const float w = __expf(plse[row] - M);
                const float4 x = *reinterpret_cast<const float4*>(po + row * head_dim + d0);
                acc.x = fmaf(x.x, w, acc.x);
                acc.y = fmaf(x.y, w, acc.y);
                acc.z = fmaf(x.z, w, acc.z);
                acc.w = fmaf(x.w, w, acc.w);
            }
            const float inv = 1.f / L;
            acc.x *= inv; acc.y *= inv; acc.z *= inv; acc.w *= inv;
        }
        *reinterpret_cast<float4*>(out_o + out + d0) = acc;
    }
    if (lane == 0) out_lse[cell] = L > 0.f ? M + __logf(L) : NEG_INF;
}
