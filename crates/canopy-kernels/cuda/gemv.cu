// The decode step's GEMVs, compiled as the continuation of layers.cu (one module, whose
// helpers they use: the RMSNorm of a normed GEMV's rows, SwiGLU, RoPE).
//
// GEMV: `out[m][n] = x[m] · w[n]` for the few rows m < rows <= GEMV_MAX_ROWS of a decode step,
// the weight streamed once at close to the memory's bandwidth (cuBLAS's GEMMs for a handful of
// rows split k and reduce in a second kernel).
//
// A warp owns GEMV_COLS consecutive output columns, a group of four lanes per column, and a
// slice of k; `slices` warps (1, 2, 4 or 8, the host's choice) share a group, GEMV_WARPS per CTA.
// k is walked in blocks of 128 bytes of every weight row: each lane loads 32 contiguous bytes
// (two 16-byte chunks) of its column's row, so a warp's load covers eight whole 128-byte lines.
// The slices take turns block by block, and each warp loads GEMV_UNROLL blocks before it uses
// any, so every lane keeps that many loads in flight. Two blocks keep the registers few enough
// for many warps per SM; on an H100, more warps streamed the Llama-3.1-8B projections faster
// than more loads per warp (four or eight blocks, or fewer registers forced by launch bounds,
// were slower: BENCHMARKS session 16). Streaming the weight through a per-warp ring in shared
// memory instead, fed by each lane's cp.async or by the copy engine's bulk copies, was slower
// too (sessions 48 and 49). Cutting k into slices gives a matrix of few columns enough warps
// to fill the GPU.
//
// A 16-bit weight is multiplied on the tensor cores: each block is four mma.m16n8k16 whose B
// operand (k16 × n8) is the weight as loaded, the lane's 32-bit words in place, and whose A
// operand (m16 × k16) holds the activation's rows m < 8 (lane / 4), rounded to the weight's
// dtype as a cuBLAS GEMM on a rounded copy would be, zeros in rows 8-15. A dot product does not
// depend on the order of k, so k is renumbered within the block to put each lane's 16
// contiguous elements where the fragment layout wants them (the same renumbering for the
// activation), and neither operand is unpacked. Each lane's accumulators are the sums of one
// activation row for two columns. An f32 weight is multiplied with fp32 FMAs, each lane
// summing its 8 elements for every row, the column's four lanes then adding theirs.
//
// The warps' sums meet in shared memory and the slices' are added in slice order, so the result
// does not depend on timing; the CTA's threads then apply the epilogue to each (row, column).
// The host launches a GEMV once the kernel before it has finished (as a programmatic dependent
// it was slower: BENCHMARKS, session 31); it lets the kernel after it launch at once, and its
// wait for the kernel before it keeps it correct under either launch.
// The weight is read once, so its loads skip L1; the activations are read by every warp and
// stay in L1. The host checks that k is a whole number of 16-byte chunks and that the buffers
// are 16-byte aligned.
//
// The epilogue is the output's: `gemv` stores, `gemv_add` adds into the output (a residual
// connection), `gemv_swiglu` computes columns n and n + cols of a fused gate|up weight (two
// weight rows per column, MATS = 2) and stores silu(gate) * up.
#define GEMV_UNROLL 2
#define GEMV_VEC (16 / (int)sizeof(elem_t))
#define GEMV_LANE_ELEMS (2 * GEMV_VEC)
#define GEMV_BLOCK (4 * GEMV_LANE_ELEMS)

__device__ __forceinline__ uint4 load_streamed(const uint4* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}

// The lane's two chunks of `block` from weight row `row` (zeros past k or when not `live`).
__device__ __forceinline__ void gemv_load(const elem_t* __restrict__ w, u64 row, bool live, u32 k, u32 block,
                                          uint4 (&chunk)[2]) {
    const u32 first = block * GEMV_BLOCK + (threadIdx.x % 4) * GEMV_LANE_ELEMS;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const u32 e = first + h * GEMV_VEC;
        chunk[h] = live && e < k ? load_streamed(reinterpret_cast<const uint4*>(w + row * k + e))
                                 : make_uint4(0u, 0u, 0u, 0u);
    }
}

// In every CTA of a normed GEMV (`gemv_normed`), once the kernel that wrote x is done: its
// `rows` activation rows normalised as rms_norm writes them (`gamma * (x * inv)`, the same
// bits) and rounded to the weight's dtype, into shared memory (`staged`, rows x k). The host
// sends only rows that row_held holds.
__device__ __forceinline__ void gemv_stage_normed(const float* __restrict__ x, const elem_t* __restrict__ gamma,
                                                  float eps, u32 rows, u32 k, elem_t* staged) {
    __shared__ float warp_sums[LAYER_THREADS / 32];
    float4 v[RMS_NORM_CHUNKS];
    for (u32 m = 0; m < rows; ++m) {
        const float inv = row_inv_rms(x + (u64)m * k, k, eps, true, v, warp_sums);
#pragma unroll
        for (int j = 0; j < RMS_NORM_CHUNKS; ++j) {
            const u32 c = threadIdx.x + j * LAYER_THREADS;
            if (c < k / 4) {
                elem_t* out = staged + (u64)m * k + 4 * c;
                out[0] = narrow(widen(gamma[4 * c]) * (v[j].x * inv));
                out[1] = narrow(widen(gamma[4 * c + 1]) * (v[j].y * inv));
                out[2] = narrow(widen(gamma[4 * c + 2]) * (v[j].z * inv));
                out[3] = narrow(widen(gamma[4 * c + 3]) * (v[j].w * inv));
            }
        }
    }
    __syncthreads();
}

// The activation row's GEMV_LANE_ELEMS elements matching the lane's chunks of `block` (zeros
// past k).
__device__ __forceinline__ void gemv_activation(const float* __restrict__ xm, u32 k, u32 block,
                                                float (&v)[GEMV_LANE_ELEMS]) {
    const u32 first = block * GEMV_BLOCK + (threadIdx.x % 4) * GEMV_LANE_ELEMS;
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int e = 0; e < GEMV_VEC; e += 4) {
            const u32 at = first + h * GEMV_VEC + e;
            const float4 t = at < k ? __ldg(reinterpret_cast<const float4*>(xm + at)) : make_float4(0.f, 0.f, 0.f, 0.f);
            v[h * GEMV_VEC + e] = t.x;
            v[h * GEMV_VEC + e + 1] = t.y;
            v[h * GEMV_VEC + e + 2] = t.z;
            v[h * GEMV_VEC + e + 3] = t.w;
        }
}

#if CANOPY_DTYPE != 0
// d += a · b, m16n8k16 with fp32 accumulators; rows 8-15 of a are zero.
__device__ __forceinline__ void mma_upper_rows(float (&d)[4], u32 a_lo, u32 a_hi, u32 b_lo, u32 b_hi) {
#if CANOPY_DTYPE == 1
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
#else
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
#endif
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a_lo), "r"(0u), "r"(a_hi), "r"(0u), "r"(b_lo), "r"(b_hi));
}
#endif

// The lane's chunks of the GEMV_UNROLL blocks from `base` on (`slices` apart) of its column's
// MATS weight rows (`mat_offset` apart); zeros past the last block, past k or past the columns.
template <int MATS>
__device__ __forceinline__ void gemv_load_blocks(const elem_t* __restrict__ w, u32 n, bool live, u64 mat_offset,
                                                 u32 k, u32 blocks, u32 base, u32 slices,
                                                 uint4 (&wc)[GEMV_UNROLL][MATS][2]) {
#pragma unroll
    for (int u = 0; u < GEMV_UNROLL; ++u)
#pragma unroll
        for (int j = 0; j < MATS; ++j)
            gemv_load(w, n + j * mat_offset, live && base + u * slices < blocks, k, base + u * slices, wc[u][j]);
}

// The warp's walk over its slice of k: the blocks from `slice` on, `slices` apart, loaded
// GEMV_UNROLL at a time into `wc` (the first ones by the caller), `body(u, block)` on each as
// its turn comes.
template <int MATS, typename Body>
__device__ __forceinline__ void gemv_walk_blocks(const elem_t* __restrict__ w, u32 n, bool live, u64 mat_offset,
                                                 u32 k, u32 blocks, u32 slice, u32 slices,
                                                 uint4 (&wc)[GEMV_UNROLL][MATS][2], Body body) {
    for (u32 base = slice; base < blocks; base += slices * GEMV_UNROLL) {
        if (base != slice) gemv_load_blocks<MATS>(w, n, live, mat_offset, k, blocks, base, slices, wc);
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; ++u) {
            const u32 block = base + u * slices;
            if (block >= blocks) break;
            body(u, block);
        }
    }
}

// A normed GEMV's norm: its weight and epsilon, and the shared memory its CTA stages the
// normalised rows in (null: a plain GEMV).
struct GemvNorm {
    const elem_t* gamma;
    float eps;
    elem_t* staged;
};

// This warp's sums for its column group and slice of k, MATS weight rows per column
// (`mat_offset` apart), written to `sums[m][c][j]` (row m, column c of the group, matrix j).
// The first blocks' weights, which are no kernel's output, are loaded before
// `wait_for_previous_grid`, which returns at once in the host's ordinary launch. A normed
// GEMV then stages its rows (gemv_stage_normed) and reads its activation from there, already
// rounded, instead of from x.
template <int MATS>
__device__ __forceinline__ void gemv_warp_sums(const elem_t* __restrict__ w, const float* __restrict__ x, u32 rows,
                                               u32 cols, u32 k, u32 group, u32 slices, u32 slice, u64 mat_offset,
                                               const GemvNorm& norm,
                                               float (&sums)[GEMV_MAX_ROWS][GEMV_COLS][MATS]) {
    const u32 lane = threadIdx.x % 32;
    const u32 n = group * GEMV_COLS + lane / 4;
    const bool live = n < cols;
    const u32 blocks = (k + GEMV_BLOCK - 1) / GEMV_BLOCK;
    uint4 wc[GEMV_UNROLL][MATS][2];
    gemv_load_blocks<MATS>(w, n, live, mat_offset, k, blocks, slice, slices, wc);
    wait_for_previous_grid();
    if (norm.staged) gemv_stage_normed(x, norm.gamma, norm.eps, rows, k, norm.staged);
#if CANOPY_DTYPE != 0
    // Lane (m, q) = (lane / 4, lane % 4): row m of the activation, columns 2q and 2q + 1 of D.
    const u32 m = lane / 4;
    float acc[MATS][4] = {};
    gemv_walk_blocks<MATS>(w, n, live, mat_offset, k, blocks, slice, slices, wc, [&](int u, u32 block) {
        u32 a[GEMV_LANE_ELEMS / 2] = {};
        if (m < rows && norm.staged) {
            // The lane's two chunks, rounded already: pairs in memory order, as pack2's.
            const u32 first = block * GEMV_BLOCK + (lane % 4) * GEMV_LANE_ELEMS;
#pragma unroll
            for (int h = 0; h < 2; ++h)
                if (first + h * GEMV_VEC < k) {
                    const uint4 c = *reinterpret_cast<const uint4*>(norm.staged + (u64)m * k + first + h * GEMV_VEC);
                    a[4 * h] = c.x;
                    a[4 * h + 1] = c.y;
                    a[4 * h + 2] = c.z;
                    a[4 * h + 3] = c.w;
                }
        } else if (m < rows) {
            float v[GEMV_LANE_ELEMS];
            gemv_activation(x + (u64)m * k, k, block, v);
#pragma unroll
            for (int i = 0; i < GEMV_LANE_ELEMS / 2; ++i) a[i] = pack2(v[2 * i], v[2 * i + 1]);
        }
#pragma unroll
        for (int j = 0; j < MATS; ++j) {
            const u32 b[8] = {wc[u][j][0].x, wc[u][j][0].y, wc[u][j][0].z, wc[u][j][0].w,
                              wc[u][j][1].x, wc[u][j][1].y, wc[u][j][1].z, wc[u][j][1].w};
#pragma unroll
            for (int t = 0; t < 4; ++t) mma_upper_rows(acc[j], a[2 * t], a[2 * t + 1], b[2 * t], b[2 * t + 1]);
        }
    });
    if (m < rows)
#pragma unroll
        for (int j = 0; j < MATS; ++j) {
            sums[m][2 * (lane % 4)][j] = acc[j][0];
            sums[m][2 * (lane % 4) + 1][j] = acc[j][1];
        }
#else
    float acc[GEMV_MAX_ROWS][MATS] = {};
    gemv_walk_blocks<MATS>(w, n, live, mat_offset, k, blocks, slice, slices, wc, [&](int u, u32 block) {
#pragma unroll
        for (int m = 0; m < GEMV_MAX_ROWS; ++m) {
            if (m >= (int)rows) break;
            float v[GEMV_LANE_ELEMS];
            if (norm.staged) {
                const u32 first = block * GEMV_BLOCK + (lane % 4) * GEMV_LANE_ELEMS;
#pragma unroll
                for (int e = 0; e < GEMV_LANE_ELEMS; ++e)
                    v[e] = first + e < k ? norm.staged[(u64)m * k + first + e] : 0.f;
            } else {
                gemv_activation(x + (u64)m * k, k, block, v);
            }
#pragma unroll
            for (int j = 0; j < MATS; ++j) {
                const uint4 c[2] = {wc[u][j][0], wc[u][j][1]};
                const float wf[8] = {__uint_as_float(c[0].x), __uint_as_float(c[0].y), __uint_as_float(c[0].z),
                                     __uint_as_float(c[0].w), __uint_as_float(c[1].x), __uint_as_float(c[1].y),
                                     __uint_as_float(c[1].z), __uint_as_float(c[1].w)};
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[m][j] = fmaf(wf[e], v[e], acc[m][j]);
            }
        }
    });
#pragma unroll
    for (int m = 0; m < GEMV_MAX_ROWS; ++m)
#pragma unroll
        for (int j = 0; j < MATS; ++j) {
            float s = acc[m][j];
            s += __shfl_xor_sync(0xffffffffu, s, 1);
            s += __shfl_xor_sync(0xffffffffu, s, 2);
            if (m < (int)rows && lane % 4 == 0) sums[m][lane / 4][j] = s;
        }
#endif
}

// A CTA's outputs once its warps' sums are in shared memory: `(g, m, c, j)` is the output of
// row m, column c of the CTA's column group g, matrix j, the slices' sums added in slice order.
template <int MATS>
struct GemvTotals {
    const float (*sums)[GEMV_MAX_ROWS][GEMV_COLS][MATS];
    u32 slices;
    __device__ __forceinline__ float operator()(u32 g, u32 m, u32 c, int j) const {
        float total = 0.f;
        for (u32 s = 0; s < slices; ++s) total += sums[g * slices + s][m][c][j];
        return total;
    }
};

// Runs every warp's sums into shared memory, the CTA's column group g being the matrix's
// `group_of(g)`, then `finish(totals, groups)`. With a norm weight `gamma` (else null), the
// product is of x's rows RMS-normalised: staged in the CTA's dynamic shared memory (rows x k
// elements, at most NORMED_GEMV_ROWS rows).
template <int MATS, typename GroupOf, typename Finish>
__device__ __forceinline__ void gemv_cta_mapped(const elem_t* __restrict__ w, const float* __restrict__ x, u32 rows,
                                                u32 cols, u32 k, u32 slices, u64 mat_offset, const elem_t* gamma,
                                                float eps, GroupOf group_of, Finish finish) {
    static_assert(GEMV_WARPS * 32 == LAYER_THREADS, "a normed GEMV's CTA normalises its rows as rms_norm's does");
    __shared__ float sums[GEMV_WARPS][GEMV_MAX_ROWS][GEMV_COLS][MATS];
    extern __shared__ __align__(16) unsigned char gemv_staged[];
    const u32 warp = threadIdx.x / 32, groups = GEMV_WARPS / slices;
    let_next_grid_launch();
    const GemvNorm norm{gamma, eps, gamma ? reinterpret_cast<elem_t*>(gemv_staged) : nullptr};
    gemv_warp_sums<MATS>(w, x, rows, cols, k, group_of(warp / slices), slices, warp % slices, mat_offset, norm,
                         sums[warp]);
    __syncthreads();
    finish(GemvTotals<MATS>{sums, slices}, groups);
}

// `gemv_cta_mapped` over consecutive column groups, calling `epilogue(m, n, sum)` once per output
// (row m, column n < cols), spread over the CTA.
template <int MATS, typename Epilogue>
__device__ __forceinline__ void gemv_cta(const elem_t* __restrict__ w, const float* __restrict__ x, u32 rows,
                                         u32 cols, u32 k, u32 slices, u64 mat_offset, const elem_t* gamma, float eps,
                                         Epilogue epilogue) {
    const u32 first_group = blockIdx.x * (GEMV_WARPS / slices);
    gemv_cta_mapped<MATS>(
        w, x, rows, cols, k, slices, mat_offset, gamma, eps, [=](u32 g) { return first_group + g; },
        [&](const GemvTotals<MATS>& total, u32 groups) {
            for (u32 i = threadIdx.x; i < groups * rows * GEMV_COLS; i += blockDim.x) {
                const u32 g = i / (rows * GEMV_COLS), m = i / GEMV_COLS % rows, c = i % GEMV_COLS;
                const u32 n = (first_group + g) * GEMV_COLS + c;
                if (n >= cols) continue;
                float t[MATS];
#pragma unroll
                for (int j = 0; j < MATS; ++j) t[j] = total(g, m, c, j);
                epilogue(m, n, t);
            }
        });
}

extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv(const elem_t* __restrict__ w, const float* __restrict__ x, float* __restrict__ out, u32 rows, u32 cols,
     u32 k, u32 slices) {
    gemv_cta<1>(w, x, rows, cols, k, slices, 0, nullptr, 0.f,
                [&](u32 m, u32 n, const float (&s)[1]) { out[(u64)m * cols + n] = s[0]; });
}

extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_add(const elem_t* __restrict__ w, const float* __restrict__ x, float* __restrict__ out, u32 rows,
         u32 cols, u32 k, u32 slices) {
    gemv_cta<1>(w, x, rows, cols, k, slices, 0, nullptr, 0.f,
                [&](u32 m, u32 n, const float (&s)[1]) { out[(u64)m * cols + n] += s[0]; });
}

__device__ __forceinline__ float silu_times(const float (&s)[2]) { return silu_mul(s[0], s[1]); }

// `cols` is the output's width: the weight has 2 * cols rows, gate's then up's.
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_swiglu(const elem_t* __restrict__ w, const float* __restrict__ x, float* __restrict__ out, u32 rows,
            u32 cols, u32 k, u32 slices) {
    gemv_cta<2>(w, x, rows, cols, k, slices, cols, nullptr, 0.f,
                [&](u32 m, u32 n, const float (&s)[2]) { out[(u64)m * cols + n] = silu_times(s); });
}

// `gemv` and `gemv_swiglu` of rms_norm(x) with weight `gamma`, in one launch instead of two:
// each CTA normalises x's rows (at most NORMED_GEMV_ROWS, held whole) into its shared memory,
// the same bits rms_norm writes, and reads its activation from there.
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_normed(const elem_t* __restrict__ w, const float* __restrict__ x, const elem_t* __restrict__ gamma, float eps,
            float* __restrict__ out, u32 rows, u32 cols, u32 k, u32 slices) {
    gemv_cta<1>(w, x, rows, cols, k, slices, 0, gamma, eps,
                [&](u32 m, u32 n, const float (&s)[1]) { out[(u64)m * cols + n] = s[0]; });
}

extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_normed_swiglu(const elem_t* __restrict__ w, const float* __restrict__ x, const elem_t* __restrict__ gamma,
                   float eps, float* __restrict__ out, u32 rows, u32 cols, u32 k, u32 slices) {
    gemv_cta<2>(w, x, rows, cols, k, slices, cols, gamma, eps,
                [&](u32 m, u32 n, const float (&s)[2]) { out[(u64)m * cols + n] = silu_times(s); });
}

// The q|k|v projection of a decode step with RoPE and the KV append in its epilogue: `gemv`
// (normalising its rows first when `gamma` is not null, as `gemv_normed`) of a fused q|k|v
// weight, whose outputs are written as `rope_split_store` writes them from the product, the
// same bits: q and k rotated, v as it is, and for each of `count` (row, slot) pairs that row's
// key and value narrowed into the pool's `slot`.
//
// A CTA's column groups come in pairs, (i, i + half) of one head, so that each of its outputs'
// rotation partners is its own: the CTA's g-th group is member g % 2 of pair
// blockIdx.x * groups / 2 + g / 2, where pair p of a head's half / GEMV_COLS holds its
// groups p and p + half / GEMV_COLS. The host sends slices of at most 4 (two groups a CTA or
// more), heads of whole groups (half a multiple of GEMV_COLS), q and k of whole heads, and
// `pairs` checked against the rows and the pool.
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_rope(const elem_t* __restrict__ w, const float* __restrict__ x, const elem_t* __restrict__ gamma, float eps,
          u32 rows, u32 k, u32 slices, const u32* __restrict__ positions, const float* __restrict__ inv_freq,
          float* __restrict__ q, float* __restrict__ kk, float* __restrict__ v, u32 q_cols, u32 kv_cols, u32 half,
          const u32* __restrict__ pairs, elem_t* __restrict__ kc, elem_t* __restrict__ vc, u32 count) {
    const u32 cols = q_cols + 2 * kv_cols, head_groups = half / GEMV_COLS, first_pair = blockIdx.x * (GEMV_WARPS / slices) / 2;
    const auto group_of = [=](u32 g) {
        const u32 pair = first_pair + g / 2;
        return pair / head_groups * 2 * head_groups + pair % head_groups + g % 2 * head_groups;
    };
    gemv_cta_mapped<1>(w, x, rows, cols, k, slices, 0, gamma, eps, group_of, [&](const GemvTotals<1>& total, u32 groups) {
        for (u32 i = threadIdx.x; i < groups / 2 * rows * GEMV_COLS; i += blockDim.x) {
            const u32 p = i / (rows * GEMV_COLS), m = i / GEMV_COLS % rows, c = i % GEMV_COLS;
            const u32 n = group_of(2 * p) * GEMV_COLS + c;  // the pair's first column
            if (n >= cols) continue;
            const u32 j = n % (2 * half), head = n - j;
            float2 out = make_float2(total(2 * p, m, c, 0), total(2 * p + 1, m, c, 0));
            if (n < q_cols + kv_cols) {
                const float2 sc = rope_angle(positions, inv_freq, m, j);
                out = rotate_pair(out.x, out.y, sc.x, sc.y);
            }
            float* dst = n < q_cols ? q + (u64)m * q_cols + head
                                    : (n < q_cols + kv_cols ? kk + (u64)m * kv_cols + head - q_cols
                                                            : v + (u64)m * kv_cols + head - q_cols - kv_cols);
            dst[j] = out.x;
            dst[j + half] = out.y;
            if (n < q_cols) continue;
            const bool is_key = n < q_cols + kv_cols;
            const u32 at = head - q_cols - (is_key ? 0u : kv_cols) + j;
            for (u32 s = 0; s < count; ++s)
                if (pairs[2 * s] == m) {
                    elem_t* cache = (is_key ? kc : vc) + (u64)pairs[2 * s + 1] * kv_cols + at;
                    cache[0] = narrow(out.x);
                    cache[half] = narrow(out.y);
                }
        }
    });
}
