// Split-KV flash decoding over a canopy plan: stage 1 (partial states). Stage 2 is merge.cu.
//
// One CTA per (plan group, KV head). The CTA streams the group's KV tokens once and applies
// each token to every query row of the group that shares the KV head (the GQA rows: queries x
// q_heads / kv_heads), so KV is read once per group whatever the GQA ratio.
//
// Layout: K and V are [token][kv_head][HEAD_DIM]; a token's head row is HEAD_DIM contiguous
// elements. LANES = HEAD_DIM / 8 lanes hold one token's row, 8 elements (16 bytes in 16-bit
// storage) each, so a warp covers TPW = 32 / LANES tokens per load and UNROLL loads per step.
//
// Loads: with one row (pure streaming, little compute per byte) each lane issues all of a
// step's 16-byte K and V loads straight into registers (DIRECT); with GQA rows (more compute per
// byte) they go through a STAGES-deep cp.async pipeline in shared memory instead, so loads for
// later steps stay in flight while the lane computes. In the pipeline each lane copies its own
// pieces and reads back only what it copied itself, so no barrier is needed. Measured on H200
// (docs/BENCHMARKS.md): direct loads reach the copy bandwidth with one row but 25% of it with
// four; the pipeline gives 84% with four and 96-98% with one. Each sub-warp (LANES lanes) keeps
// its own online-softmax state per row, in the log2 domain (queries are pre-scaled by
// scale * log2(e)); at the end the CTA merges the sub-warp states in shared memory (reusing the
// pipeline's space) and writes one normalised partial (o, natural-log lse) per (query, head).
// Masked groups test one bit per (token, query); paged KV maps a logical token through the
// page table; a group's tokens may span several KV ranges.
//
// Compile-time parameters: CANOPY_DTYPE, HEAD_DIM, ROWS (rows per pass; more rows loop).

#ifndef HEAD_DIM
#error "HEAD_DIM must be defined by the kernel registry"
#endif
#ifndef ROWS
#error "ROWS must be defined by the kernel registry"
#endif

#ifndef DECODE_THREADS
#error "DECODE_THREADS must be defined by the kernel registry"
#endif
#define THREADS DECODE_THREADS
#define NWARPS (THREADS / 32)
#define LANES (HEAD_DIM / 8)
#define TPW (32 / LANES)
#define SLOTS (NWARPS * TPW)
#define STAGES 3
#define DIRECT (ROWS == 1)
#if CANOPY_DTYPE == 0
#define UNROLL 2
#define RAWV 2  // 16-byte pieces per 8 elements
#else
#define UNROLL 4
#define RAWV 1
#endif
#define WARP_STEP (TPW * UNROLL)
// When a step's scores (ROWS x UNROLL) are as many as a token's lanes, a reduce-scatter leaves
// each lane one finished score, and the softmax runs once per (row, token) instead of in every
// lane: 43 shuffles, 5 exp2 and 15 adds a step for the Llama shape instead of 64, 20 and 64.
#define TRANSPOSED (ROWS * UNROLL == LANES)
#define CTA_STEP (NWARPS * WARP_STEP)
// Register budget (from the compiler's resource report for sm_90a): up to 4 rows fit 128
// registers without spilling, so they ask for 4 CTAs per SM (48 KB of shared memory each);
// 8 rows keep the compiler's choice (forcing it spills).
#if ROWS <= 4
#define MIN_CTAS 4
#else
#define MIN_CTAS 1
#endif

// Per group: range_begin, range_count, query_begin, query_count, partial_base,
// mask_begin + 1 (0: unmasked; the mask in `mask_word`'s layout), tokens, flags. This kernel
// loads every group's KV without an L2 hint: GROUP_KV_STREAMED is for the tensor-core kernel
// (the one-row path's loads, behind a branch on it, made Q-guided plans at 32/32 7-53% slower:
// BENCHMARKS, session 11).
#ifndef GROUP_WORDS
#error "GROUP_WORDS must be defined by the kernel registry"
#endif

struct MergeScratch {
    float m[SLOTS][ROWS];
    float l[SLOTS][ROWS];
    float acc[SLOTS][ROWS][HEAD_DIM];
};

union SharedSpace {
#if !DIRECT
    uint4 pipe[STAGES * UNROLL * 2 * RAWV][THREADS];  // lane-minor: conflict-free
#endif
    MergeScratch merge;
};

// Walks a group's KV ranges in token order: maps group-local token indices to addresses.
struct Cursor {
    u32 ri, local_begin, local_end, addr_begin;
};

__device__ __forceinline__ void cursor_start(Cursor& c, const u32* ranges, u32 range_begin) {
    c.ri = 0;
    c.local_begin = 0;
    c.addr_begin = ranges[2 * range_begin];
    c.local_end = ranges[2 * range_begin + 1] - c.addr_begin;
}

__device__ __forceinline__ u32 cursor_seek(Cursor& c, u32 local, const u32* ranges, u32 range_begin) {
    while (local >= c.local_end) {
        ++c.ri;
        const u32 rs = ranges[2 * (range_begin + c.ri)], re = ranges[2 * (range_begin + c.ri) + 1];
        c.local_begin = c.local_end;
        c.local_end += re - rs;
        c.addr_begin = rs;
    }
    return c.addr_begin + (local - c.local_begin);
}

// One step of the reduce-scatter: the lane keeps one half of its 2 * O values (the upper half
// when its bit O is set) and adds its partner's copy of that half. O is a template parameter so
// every index is a constant: a run-time index would move x to local memory, and so would the
// select `upper ? x[i] : x[i + O]` (folded into an index), hence the bit-mask select.
template <int O>
__device__ __forceinline__ void reduce_scatter_step(float* x, int lane) {
    const u32 upper = (lane & O) ? 0xffffffffu : 0u;
#pragma unroll
    for (int i = 0; i < O; ++i) {
        const u32 lo = __float_as_uint(x[i]), hi = __float_as_uint(x[i + O]);
        const float send = __uint_as_float((lo & upper) | (hi & ~upper));
        const float keep = __uint_as_float((hi & upper) | (lo & ~upper));
        x[i] = keep + __shfl_xor_sync(0xffffffffu, send, O);
    }
}

__device__ __forceinline__ void cp_async_wait_ahead() { asm volatile("cp.async.wait_group %0;\n" ::"n"(STAGES - 1)); }

// A 16-byte load that bypasses L1 (KV is read once per CTA).
__device__ __forceinline__ uint4 ld_stream(const void* p) {
    uint4 r;
    asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p));
    return r;
}

extern "C" __global__ void __launch_bounds__(THREADS, MIN_CTAS)
decode_partial(STAGE1_PARAMS) {
    let_next_grid_launch();
    const u32* gd = groups + (u64)blockIdx.x * GROUP_WORDS;
    const u32 range_begin = gd[0], query_begin = gd[2];
    const u32 query_count = gd[3], partial_base = gd[4], mask_plus1 = gd[5], tokens = gd[6];
    const int kvh = blockIdx.y;
    const int gsz = q_heads / kv_heads;
    // A place past the plan's own groups (room for larger plans) has no queries: no rows.
    const int total_rows = (int)query_count * gsz;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int sub = lane / LANES, dim0 = (lane % LANES) * 8;
    const u64 tok_stride = (u64)kv_heads * HEAD_DIM;
    const u32 page_mask = (1u << page_shift) - 1u;
    const u32 steps = (tokens + CTA_STEP - 1) / CTA_STEP;

    __shared__ SharedSpace sh;

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
        Cursor cur[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) cursor_start(cur[u], ranges, range_begin);

        // Byte offset of this lane's piece of token slot `u` of `step`, or ~0 past the end.
        auto piece = [&](u32 step, int u) -> u64 {
            const u32 local = step * CTA_STEP + warp * WARP_STEP + u * TPW + sub;
            if (local >= tokens) return ~0ull;
            const u32 t = cursor_seek(cur[u], local, ranges, range_begin);
            const u32 addr = page_table ? (page_table[t >> page_shift] << page_shift) | (t & page_mask) : t;
            return ((u64)addr * tok_stride + (u64)kvh * HEAD_DIM + dim0) * ELEM_BYTES;
        };
#if !DIRECT
        // Copies step `step`'s K and V pieces of this lane into pipeline stage step % STAGES.
        auto issue = [&](u32 step) {
            if (step < steps) {
                const int stage = step % STAGES;
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) {
                    const u64 off = piece(step, u);
                    const bool valid = off != ~0ull;
#pragma unroll
                    for (int w = 0; w < RAWV; ++w) {
                        const u64 at = valid ? off + 16 * w : 0;
                        cp_async16(&sh.pipe[((stage * UNROLL + u) * 2 + 0) * RAWV + w][threadIdx.x], kc + at, valid ? 16 : 0, false);
                        cp_async16(&sh.pipe[((stage * UNROLL + u) * 2 + 1) * RAWV + w][threadIdx.x], vc + at, valid ? 16 : 0, false);
                    }
                }
            }
            cp_async_commit();  // an empty group past the end keeps the wait count uniform
        };
#pragma unroll
        for (int s = 0; s < STAGES - 1; ++s) issue(s);
#endif
        for (u32 step = 0; step < steps; ++step) {
            // This step's raw K and V pieces: loaded into registers now (DIRECT), or read from
            // the pipeline stage when used (so they never all occupy registers at once).
#if DIRECT
            Raw8 kr[UNROLL], vr[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const u64 off = piece(step, u);
                const bool valid = off != ~0ull;
                kr[u].a = valid ? ld_stream(kc + off) : make_uint4(0, 0, 0, 0);
                vr[u].a = valid ? ld_stream(vc + off) : make_uint4(0, 0, 0, 0);
#if CANOPY_DTYPE == 0
                kr[u].b = valid ? ld_stream(kc + off + 16) : make_uint4(0, 0, 0, 0);
                vr[u].b = valid ? ld_stream(vc + off + 16) : make_uint4(0, 0, 0, 0);
#endif
            }
            auto fetch = [&](int u, int which) -> Raw8 { return which == 0 ? kr[u] : vr[u]; };
#else
            issue(step + STAGES - 1);
            cp_async_wait_ahead();
            const int stage = step % STAGES;
            auto fetch = [&](int u, int which) -> Raw8 {
                Raw8 r;
                r.a = sh.pipe[((stage * UNROLL + u) * 2 + which) * RAWV][threadIdx.x];
#if CANOPY_DTYPE == 0
                r.b = sh.pipe[((stage * UNROLL + u) * 2 + which) * RAWV + 1][threadIdx.x];
#endif
                return r;
            };
#endif
            const u32 local0 = step * CTA_STEP + warp * WARP_STEP + sub;
            // Scores of every row for this step's tokens.
            float s[ROWS][UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                float kf[8];
                widen8(fetch(u, 0), kf);
#pragma unroll
                for (int r = 0; r < ROWS; ++r) {
                    float d = 0.f;
#pragma unroll
                    for (int i = 0; i < 8; ++i) d = fmaf(qf[r][i], kf[i], d);
                    s[r][u] = d;
                }
            }
#if TRANSPOSED
            // Reduce-scatter over the LANES lanes of a token: afterwards lane ls (= lane % LANES)
            // holds the full score of (row ls / UNROLL, token ls % UNROLL).
            float x[ROWS * UNROLL];
#pragma unroll
            for (int r = 0; r < ROWS; ++r)
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) x[r * UNROLL + u] = s[r][u];
            if (LANES >= 32) reduce_scatter_step<16>(x, lane);
            if (LANES >= 16) reduce_scatter_step<8>(x, lane);
            reduce_scatter_step<4>(x, lane);
            reduce_scatter_step<2>(x, lane);
            reduce_scatter_step<1>(x, lane);
            const int ls = lane % LANES, base = lane - ls;
            const int r_me = ls / UNROLL, u_me = ls % UNROLL;
            float score = x[0];
            {
                const u32 local = local0 + u_me * TPW;
                bool keep = local < tokens && r_me < nrows;
                const u32 j = (u32)(row0 + r_me) / gsz;
                if (keep && mask_plus1) keep = (*mask_word(masks + mask_plus1 - 1, local, query_count, j) >> (local % 64)) & 1ull;
                if (!keep) score = NEG_INF;
            }
            float row_max = score;
#pragma unroll
            for (int o = 1; o < UNROLL; o *= 2) row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, o));
            float m_new[ROWS], m_mine = NEG_INF;
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                m_new[r] = fmaxf(m[r], __shfl_sync(0xffffffffu, row_max, base + r * UNROLL));
                if (r == r_me) m_mine = m_new[r];
            }
            const float p_mine = m_mine == NEG_INF ? 0.f : fast_exp2(score - m_mine);
            float row_sum = p_mine;
#pragma unroll
            for (int o = 1; o < UNROLL; o *= 2) row_sum += __shfl_xor_sync(0xffffffffu, row_sum, o);
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                const float sum = __shfl_sync(0xffffffffu, row_sum, base + r * UNROLL);
                const float alpha = m_new[r] == NEG_INF ? 1.f : fast_exp2(m[r] - m_new[r]);
                l[r] = l[r] * alpha + sum;
                m[r] = m_new[r];
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[r][i] *= alpha;
            }
            auto prob = [&](int r, int u) { return __shfl_sync(0xffffffffu, p_mine, base + r * UNROLL + u); };
#else
            float p[ROWS][UNROLL] = {};
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                if (r >= nrows) break;  // uniform across the CTA
#pragma unroll
                for (int u = 0; u < UNROLL; ++u)
#pragma unroll
                    for (int off = LANES / 2; off > 0; off /= 2) s[r][u] += __shfl_xor_sync(0xffffffffu, s[r][u], off);
                const u32 j = (u32)(row0 + r) / gsz;
                float mx = NEG_INF;
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) {
                    const u32 local = local0 + u * TPW;
                    bool keep = local < tokens;
                    if (keep && mask_plus1) keep = (*mask_word(masks + mask_plus1 - 1, local, query_count, j) >> (local % 64)) & 1ull;
                    if (!keep) s[r][u] = NEG_INF;
                    mx = fmaxf(mx, s[r][u]);
                }
                const float m_new = fmaxf(m[r], mx);
                const float alpha = m_new == NEG_INF ? 1.f : fast_exp2(m[r] - m_new);
                float lsum = l[r] * alpha;
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) {
                    p[r][u] = m_new == NEG_INF ? 0.f : fast_exp2(s[r][u] - m_new);
                    lsum += p[r][u];
                }
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[r][i] *= alpha;
                l[r] = lsum;
                m[r] = m_new;
            }
            auto prob = [&](int r, int u) { return p[r][u]; };
#endif
            // Accumulate V, weighted by each row's probabilities (rows past nrows weigh 0).
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                float vf[8];
                widen8(fetch(u, 1), vf);
#pragma unroll
                for (int r = 0; r < ROWS; ++r) {
                    const float pr = prob(r, u);
#pragma unroll
                    for (int i = 0; i < 8; ++i) acc[r][i] = fmaf(pr, vf[i], acc[r][i]);
                }
            }
        }
#if !DIRECT
        asm volatile("cp.async.wait_all;\n" ::);
#endif
        __syncthreads();  // every warp is done with the pipeline before it becomes merge scratch
        // Merge the sub-warps' states.
        const int slot = warp * TPW + sub;
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            if (r < nrows) {
                if (lane % LANES == 0) {
                    sh.merge.m[slot][r] = m[r];
                    sh.merge.l[slot][r] = l[r];
                }
#pragma unroll
                for (int i = 0; i < 8; ++i) sh.merge.acc[slot][r][dim0 + i] = acc[r][i];
            }
        }
        __syncthreads();
        for (int idx = threadIdx.x; idx < nrows * HEAD_DIM; idx += THREADS) {
            const int r = idx / HEAD_DIM, d = idx % HEAD_DIM;
            float M = NEG_INF;
#pragma unroll
            for (int s = 0; s < SLOTS; ++s) M = fmaxf(M, sh.merge.m[s][r]);
            float L = 0.f, O = 0.f;
            if (M != NEG_INF) {
#pragma unroll
                for (int s = 0; s < SLOTS; ++s) {
                    const float w = fast_exp2(sh.merge.m[s][r] - M);
                    L = fmaf(sh.merge.l[s][r], w, L);
                    O = fmaf(sh.merge.acc[s][r][d], w, O);
                }
            }
            const int row = row0 + r;
            const u64 prow = (u64)partial_base + row / gsz;
            const int head = kvh * gsz + row % gsz;
            const bool empty = L == 0.f;
            out_o[(prow * q_heads + head) * HEAD_DIM + d] = empty ? 0.f : O / L;
            if (d == 0) out_lse[prow * q_heads + head] = empty ? NEG_INF : (M + __log2f(L)) * LN2;
        }
        __syncthreads();  // the scratch is the next pass's pipeline
    }
}
