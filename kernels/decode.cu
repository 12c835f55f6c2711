// Split-KV flash decoding over a canopy plan: stage 1 (partial states). Stage 2 is merge.cu.
//
// Stage 1: one CTA per (plan group, KV head). The CTA streams the group's KV token ranges
// once and applies each token to every query row of the group that shares the KV head (the
// GQA rows: queries x q_heads/kv_heads), so KV is read once per group whatever the GQA ratio.
//
// Layout: K and V are [token][kv_head][HEAD_DIM]; a token's head row is HEAD_DIM contiguous
// elements. LANES = HEAD_DIM / 8 lanes hold one token's row, 8 elements (16 bytes in 16-bit
// storage) each, so a warp covers TPW = 32 / LANES tokens per load and each lane keeps UNROLL
// K and UNROLL V loads in flight. Each sub-warp (LANES lanes) keeps its own online-softmax state
// per row (in the log2 domain: queries are pre-scaled by scale * log2(e)); the CTA merges the
// sub-warp states in shared memory and writes one normalised partial (o, natural-log lse) per
// (query, head). Masked groups test one bit per (token, query); paged KV maps a logical token
// through the page table.
//
// Compile-time parameters: CANOPY_DTYPE, HEAD_DIM, ROWS (rows per pass; more rows loop).

#define NWARPS 4
#define LANES (HEAD_DIM / 8)
#define TPW (32 / LANES)
#define SLOTS (NWARPS * TPW)
// Register budget (from the compiler's resource report for sm_90a): one row fits 128
// registers with 4 tokens in flight per lane, so it asks for 4 CTAs per SM; more rows keep the
// compiler's choice (forcing it spills), and 4+ rows trade in-flight tokens for registers.
#if ROWS >= 4
#define UNROLL 2
#else
#define UNROLL 4
#endif
#if ROWS == 1
#define MIN_CTAS 4
#else
#define MIN_CTAS 1
#endif

// Per group: range_begin, range_count, query_begin, query_count, partial_base, mask_begin + 1
// (0: unmasked).
#define GROUP_WORDS 6

extern "C" __global__ void __launch_bounds__(NWARPS * 32, MIN_CTAS)
decode_partial(const unsigned char* __restrict__ kc, const unsigned char* __restrict__ vc,
               const float* __restrict__ q, const u32* __restrict__ groups,
               const u32* __restrict__ ranges, const u32* __restrict__ group_queries,
               const u64* __restrict__ masks, const u32* __restrict__ page_table, u32 page_shift,
               float* __restrict__ out_o, float* __restrict__ out_lse, int q_heads, int kv_heads,
               float scale_log2) {
    const u32* gd = groups + (u64)blockIdx.x * GROUP_WORDS;
    const u32 range_begin = gd[0], range_count = gd[1], query_begin = gd[2];
    const u32 query_count = gd[3], partial_base = gd[4], mask_plus1 = gd[5];
    const int kvh = blockIdx.y;
    const int gsz = q_heads / kv_heads;
    const int total_rows = (int)query_count * gsz;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int sub = lane / LANES, dim0 = (lane % LANES) * 8;
    const u32 words = (query_count + 63) / 64;
    const u64 tok_stride = (u64)kv_heads * HEAD_DIM;
    const u32 page_mask = (1u << page_shift) - 1u;

    __shared__ float sm_m[SLOTS][ROWS];
    __shared__ float sm_l[SLOTS][ROWS];
    __shared__ float sm_acc[SLOTS][ROWS][HEAD_DIM];

    for (int row0 = 0; row0 < total_rows; row0 += ROWS) {
        const int nrows = min(ROWS, total_rows - row0);
        float qf[ROWS][8], acc[ROWS][8], m[ROWS], l[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            m[r] = NEG_INF;
            l[r] = 0.f;
#pragma unroll
            for (int i = 0; i < 8; ++i) { acc[r][i] = 0.f; qf[r][i] = 0.f; }
            if (r < nrows) {
                const int row = row0 + r;
                const u32 query = group_queries[query_begin + row / gsz];
                const int head = kvh * gsz + row % gsz;
                const float* qp = q + ((u64)query * q_heads + head) * HEAD_DIM + dim0;
#pragma unroll
                for (int i = 0; i < 8; ++i) qf[r][i] = qp[i] * scale_log2;
            }
        }
        u32 tok_base = 0;  // group-local index of the current range's first token
        for (u32 ri = 0; ri < range_count; ++ri) {
            const u32 rs = ranges[2 * (range_begin + ri)], re = ranges[2 * (range_begin + ri) + 1];
            for (u32 t0 = rs + warp * TPW * UNROLL; t0 < re; t0 += NWARPS * TPW * UNROLL) {
                Raw8 kr[UNROLL], vr[UNROLL];
                u32 tok[UNROLL];
                bool valid[UNROLL];
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) {
                    tok[u] = t0 + u * TPW + sub;
                    valid[u] = tok[u] < re;
                    if (valid[u]) {
                        const u32 addr = page_table
                            ? (page_table[tok[u] >> page_shift] << page_shift) | (tok[u] & page_mask)
                            : tok[u];
                        const u64 off = (u64)addr * tok_stride + (u64)kvh * HEAD_DIM + dim0;
                        kr[u] = load8(kc, off);
                        vr[u] = load8(vc, off);
                    }
                }
                float kf[UNROLL][8], vf[UNROLL][8];
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) {
                    if (valid[u]) {
                        widen8(kr[u], kf[u]);
                        widen8(vr[u], vf[u]);
                    } else {
#pragma unroll
                        for (int i = 0; i < 8; ++i) { kf[u][i] = 0.f; vf[u][i] = 0.f; }
                    }
                }
#pragma unroll
                for (int r = 0; r < ROWS; ++r) {
                    if (r >= nrows) break;  // uniform across the CTA
                    float s[UNROLL];
#pragma unroll
                    for (int u = 0; u < UNROLL; ++u) {
                        float d = 0.f;
#pragma unroll
                        for (int i = 0; i < 8; ++i) d = fmaf(qf[r][i], kf[u][i], d);
#pragma unroll
                        for (int off = LANES / 2; off > 0; off /= 2) d += __shfl_xor_sync(0xffffffffu, d, off);
                        s[u] = d;
                    }
                    const u32 j = (u32)(row0 + r) / gsz;
                    float mx = NEG_INF;
#pragma unroll
                    for (int u = 0; u < UNROLL; ++u) {
                        bool keep = valid[u];
                        if (keep && mask_plus1) {
                            const u64 local = tok_base + (tok[u] - rs);
                            keep = (masks[mask_plus1 - 1 + local * words + j / 64] >> (j % 64)) & 1ull;
                        }
                        if (!keep) s[u] = NEG_INF;
                        mx = fmaxf(mx, s[u]);
                    }
                    const float m_new = fmaxf(m[r], mx);
                    if (m_new == NEG_INF) continue;
                    const float alpha = fast_exp2(m[r] - m_new);
                    float lsum = l[r] * alpha;
#pragma unroll
                    for (int i = 0; i < 8; ++i) acc[r][i] *= alpha;
#pragma unroll
                    for (int u = 0; u < UNROLL; ++u) {
                        const float p = fast_exp2(s[u] - m_new);
                        lsum += p;
#pragma unroll
                        for (int i = 0; i < 8; ++i) acc[r][i] = fmaf(p, vf[u][i], acc[r][i]);
                    }
                    l[r] = lsum;
                    m[r] = m_new;
                }
            }
            tok_base += re - rs;
        }
        // Merge the sub-warps' states.
        const int slot = warp * TPW + sub;
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            if (r < nrows) {
                if (lane % LANES == 0) {
                    sm_m[slot][r] = m[r];
                    sm_l[slot][r] = l[r];
                }
#pragma unroll
                for (int i = 0; i < 8; ++i) sm_acc[slot][r][dim0 + i] = acc[r][i];
            }
        }
        __syncthreads();
        for (int idx = threadIdx.x; idx < nrows * HEAD_DIM; idx += NWARPS * 32) {
            const int r = idx / HEAD_DIM, d = idx % HEAD_DIM;
            float M = NEG_INF;
#pragma unroll
            for (int s = 0; s < SLOTS; ++s) M = fmaxf(M, sm_m[s][r]);
            float L = 0.f, O = 0.f;
            if (M != NEG_INF) {
#pragma unroll
                for (int s = 0; s < SLOTS; ++s) {
                    const float w = fast_exp2(sm_m[s][r] - M);
                    L = fmaf(sm_l[s][r], w, L);
                    O = fmaf(sm_acc[s][r][d], w, O);
                }
            }
            const int row = row0 + r;
            const u64 prow = (u64)partial_base + row / gsz;
            const int head = kvh * gsz + row % gsz;
            const bool empty = L == 0.f;
            out_o[(prow * q_heads + head) * HEAD_DIM + d] = empty ? 0.f : O / L;
            if (d == 0) out_lse[prow * q_heads + head] = empty ? NEG_INF : (M + __log2f(L)) * LN2;
        }
        __syncthreads();
    }
}
