// Stage 2 of decoding: partial states to one state per query, following the plan's CSR map.

// Stage 2: one CTA per (query, head) folds the query's partial rows in CSR order (no atomics,
// so the result is bit-for-bit reproducible). A query with no rows gets the empty partial.
extern "C" __global__ void merge_partials(const float* __restrict__ po, const float* __restrict__ plse,
                                          const u32* __restrict__ query_ptr, const u32* __restrict__ query_rows,
                                          float* __restrict__ out_o, float* __restrict__ out_lse, int q_heads,
                                          int head_dim) {
    const u32 qi = blockIdx.x;
    const int h = blockIdx.y;
    const u32 b = query_ptr[qi], e = query_ptr[qi + 1];
    float M = NEG_INF;
    for (u32 i = b; i < e; ++i) M = fmaxf(M, plse[(u64)query_rows[i] * q_heads + h]);
    float L = 0.f;
    if (M != NEG_INF)
        for (u32 i = b; i < e; ++i) L += __expf(plse[(u64)query_rows[i] * q_heads + h] - M);
    const u64 out = ((u64)qi * q_heads + h) * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float o = 0.f;
        if (L > 0.f) {
            for (u32 i = b; i < e; ++i) {
                const u64 row = query_rows[i];
                const float w = __expf(plse[row * q_heads + h] - M);
                o = fmaf(po[(row * q_heads + h) * head_dim + d], w, o);
            }
            o /= L;
        }
        out_o[out + d] = o;
    }
    if (threadIdx.x == 0) out_lse[(u64)qi * q_heads + h] = L > 0.f ? M + __logf(L) : NEG_INF;
}
