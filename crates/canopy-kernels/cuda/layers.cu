// The dense half of a transformer layer (canopy_engine::LayerOps on the CUDA backend).
//
// Activations are fp32 row-major matrices; weights and KV are stored as CANOPY_DTYPE (`elem_t`:
// f32, f16 or bf16) and widened to fp32 on load, so every kernel's arithmetic is fp32. The
// GEMMs are cuBLAS's; these kernels are what surrounds them: rounding activations to the
// weights' dtype for a 16-bit GEMM, the embedding gather, RMSNorm, RoPE (splitting a fused
// q|k|v projection), SwiGLU, the KV store by (row, slot) pairs, and attention of a block of
// query rows over a block of keys. A projection of a few rows (a decode step) is not cuBLAS's
// but `gemv`'s, which streams the weight once at close to the memory's bandwidth and folds the
// residual add or SwiGLU into its output.
//
// The element-wise kernels are grid-stride loops over LAYER_THREADS-thread CTAs, so any grid
// covers any size. Every op follows transformers' Llama in fp32; accurate libm calls (expf,
// sincosf, logf; no fast-math) keep them within rounding of the host's f32 ops.

#ifndef LAYER_THREADS
#error "LAYER_THREADS must be defined by the kernel registry"
#endif
#ifndef ATTENTION_MAX_HEAD_DIM
#error "ATTENTION_MAX_HEAD_DIM must be defined by the kernel registry"
#endif
#ifndef GEMV_WARPS
#error "GEMV_WARPS must be defined by the kernel registry"
#endif
#ifndef GEMV_MAX_ROWS
#error "GEMV_MAX_ROWS must be defined by the kernel registry"
#endif
#ifndef RMS_NORM_CHUNKS
#error "RMS_NORM_CHUNKS must be defined by the kernel registry"
#endif

#if CANOPY_DTYPE == 0
typedef float elem_t;
__device__ __forceinline__ float widen(float x) { return x; }
__device__ __forceinline__ float narrow(float x) { return x; }
#elif CANOPY_DTYPE == 1
typedef u16 elem_t;
__device__ __forceinline__ float widen(u16 x) { return f16_to_f32(x); }
__device__ __forceinline__ u16 narrow(float x) { return f32_to_f16_rn(x); }
#else
typedef u16 elem_t;
__device__ __forceinline__ float widen(u16 x) { return __uint_as_float((u32)x << 16); }
__device__ __forceinline__ u16 narrow(float x) { return f32_to_bf16_rn(x); }
#endif

#define GRID_STRIDE(i, n) \
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < (n); i += (u64)gridDim.x * blockDim.x)

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int o = 16; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

// `out = x` rounded to the weights' dtype: a 16-bit GEMM's activation operand.
extern "C" __global__ void round_to_elem(const float* __restrict__ x, elem_t* __restrict__ out, u64 n) {
    GRID_STRIDE(i, n) out[i] = narrow(x[i]);
}

// `out[r] = table[ids[r]]`, widened (the host has checked every id against the table).
extern "C" __global__ void embed_rows(const elem_t* __restrict__ table, const u32* __restrict__ ids,
                                      float* __restrict__ out, u32 rows, u32 cols) {
    GRID_STRIDE(i, (u64)rows * cols) {
        const u64 r = i / cols, c = i % cols;
        out[i] = widen(table[(u64)ids[r] * cols + c]);
    }
}

// One CTA per row: `out = w * (x / sqrt(mean(x²) + eps))`, the host's order of operations.
// A row of up to RMS_NORM_CHUNKS float4s per thread is read once into registers, every load in
// flight at once (a decode step's single row is a chain of latencies otherwise); a longer or
// unaligned row is read twice.
extern "C" __global__ void __launch_bounds__(LAYER_THREADS)
rms_norm(const float* __restrict__ x, const elem_t* __restrict__ w, float* __restrict__ out, u32 cols,
         float eps) {
    __shared__ float warp_sums[LAYER_THREADS / 32];
    const float* row = x + (u64)blockIdx.x * cols;
    float* dst = out + (u64)blockIdx.x * cols;
    const bool held = cols % 4 == 0 && cols <= 4u * LAYER_THREADS * RMS_NORM_CHUNKS;
    float4 v[RMS_NORM_CHUNKS];
    float s = 0.f;
    if (held) {
        const float4* row4 = reinterpret_cast<const float4*>(row);
#pragma unroll
        for (int j = 0; j < RMS_NORM_CHUNKS; ++j) {
            const u32 c = threadIdx.x + j * LAYER_THREADS;
            v[j] = c < cols / 4 ? row4[c] : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int j = 0; j < RMS_NORM_CHUNKS; ++j)
            s = fmaf(v[j].w, v[j].w, fmaf(v[j].z, v[j].z, fmaf(v[j].y, v[j].y, fmaf(v[j].x, v[j].x, s))));
    } else {
        for (u32 c = threadIdx.x; c < cols; c += LAYER_THREADS) s = fmaf(row[c], row[c], s);
    }
    s = warp_sum(s);
    if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = s;
    __syncthreads();
    s = threadIdx.x < LAYER_THREADS / 32 ? warp_sums[threadIdx.x] : 0.f;
    if (threadIdx.x < 32) s = warp_sum(s);
    if (threadIdx.x == 0) warp_sums[0] = s;
    __syncthreads();
    const float inv = 1.f / sqrtf(warp_sums[0] / (float)cols + eps);
    if (held) {
#pragma unroll
        for (int j = 0; j < RMS_NORM_CHUNKS; ++j) {
            const u32 c = threadIdx.x + j * LAYER_THREADS;
            if (c < cols / 4) {
                float4 o;
                o.x = widen(w[4 * c]) * (v[j].x * inv);
                o.y = widen(w[4 * c + 1]) * (v[j].y * inv);
                o.z = widen(w[4 * c + 2]) * (v[j].z * inv);
                o.w = widen(w[4 * c + 3]) * (v[j].w * inv);
                reinterpret_cast<float4*>(dst)[c] = o;
            }
        }
    } else {
        for (u32 c = threadIdx.x; c < cols; c += LAYER_THREADS) dst[c] = widen(w[c]) * (row[c] * inv);
    }
}

// Splits each row of a fused projection `qkv` (`q_cols | kv_cols | kv_cols`) into q, k and v,
// rotating every head (2 * half columns) of q and k by positions[r] (rotate_half): one thread
// per pair (i, i + half) of a q or k head, angle positions[r] * inv_freq[i] in fp32, then one
// per element of v.
extern "C" __global__ void rope_split(const float* __restrict__ qkv, const u32* __restrict__ positions,
                                      const float* __restrict__ inv_freq, float* __restrict__ q,
                                      float* __restrict__ k, float* __restrict__ v, u32 rows,
                                      u32 q_cols, u32 kv_cols, u32 half) {
    const u32 width = q_cols + 2 * kv_cols, pairs = (q_cols + kv_cols) / 2;
    GRID_STRIDE(i, (u64)rows * pairs) {
        const u64 r = i / pairs;
        const u32 p = (u32)(i % pairs), head = p / half, j = p % half;
        float s, c;
        sincosf((float)positions[r] * inv_freq[j], &s, &c);
        const u32 col = head * 2 * half;
        const float* h = qkv + r * width + col;
        const float x1 = h[j], x2 = h[j + half];
        float* dst = col < q_cols ? q + r * q_cols + col : k + r * kv_cols + (col - q_cols);
        dst[j] = x1 * c - x2 * s;
        dst[j + half] = x2 * c + x1 * s;
    }
    GRID_STRIDE(i, (u64)rows * kv_cols) {
        const u64 r = i / kv_cols, c = i % kv_cols;
        v[i] = qkv[r * width + q_cols + kv_cols + c];
    }
}

// `out = silu(gate) * up`, gate and up the two halves of each row of `gate_up` (`rows × 2
// cols`): the SwiGLU of a fused gate|up projection.
extern "C" __global__ void swiglu(const float* __restrict__ gate_up, float* __restrict__ out, u32 rows,
                                  u32 cols) {
    GRID_STRIDE(i, (u64)rows * cols) {
        const u64 r = i / cols, c = i % cols;
        const float g = gate_up[r * 2 * cols + c], u = gate_up[r * 2 * cols + cols + c];
        out[i] = g / (1.f + expf(-g)) * u;
    }
}

// For each of `count` (row, slot) pairs, row `row` of k and v (`width` values) into physical
// token slot `slot` of the KV pool, narrowed to the KV's dtype (the host has checked every row
// against k and v and every slot against the pool).
extern "C" __global__ void store_kv(const float* __restrict__ k, const float* __restrict__ v,
                                    const u32* __restrict__ pairs, elem_t* __restrict__ kc,
                                    elem_t* __restrict__ vc, u32 count, u32 width) {
    GRID_STRIDE(i, (u64)count * width) {
        const u64 p = i / width, c = i % width;
        const u64 from = (u64)pairs[2 * p] * width + c, to = (u64)pairs[2 * p + 1] * width + c;
        kc[to] = narrow(k[from]);
        vc[to] = narrow(v[from]);
    }
}

// Attention of query rows over one block of keys, merged into the rows' states.
//
// One warp per (row, head), LAYER_THREADS / 32 per CTA; lane l holds elements l + 32 j of the
// head's query and output. The warp walks the block's keys in order, skipping those after the
// row's position (a warp-uniform test), with an online softmax in fp32 on the natural-log
// scale. The block's state (o normalised, lse) then merges into the existing one exactly as
// canopy_core::merge_state does: a block with no visible key leaves it as it is, and an empty
// state (lse = -inf) takes the block's as it is, so an empty never meets `-inf - -inf`.
extern "C" __global__ void __launch_bounds__(LAYER_THREADS)
causal_attention(const float* __restrict__ q, const u32* __restrict__ q_pos, const float* __restrict__ k,
                 const float* __restrict__ v, const u32* __restrict__ k_pos, u32 tokens,
                 float* __restrict__ o, float* __restrict__ lse, u32 rows, u32 q_heads, u32 kv_heads,
                 u32 head_dim, float scale) {
    constexpr int PER_LANE = ATTENTION_MAX_HEAD_DIM / 32;
    const int lane = threadIdx.x % 32;
    const u64 cell = (u64)blockIdx.x * (LAYER_THREADS / 32) + threadIdx.x / 32;
    if (cell >= (u64)rows * q_heads) return;
    const u32 row = (u32)(cell / q_heads), head = (u32)(cell % q_heads);
    const u32 kvh = head / (q_heads / kv_heads);
    const int n = (int)(head_dim / 32);
    const u32 pos = q_pos[row];

    float qv[PER_LANE], acc[PER_LANE];
#pragma unroll
    for (int j = 0; j < PER_LANE; ++j) {
        qv[j] = j < n ? q[cell * head_dim + lane + 32 * j] : 0.f;
        acc[j] = 0.f;
    }
    float m = NEG_INF, l = 0.f;
    for (u32 t = 0; t < tokens; ++t) {
        if (k_pos[t] > pos) continue;
        const u64 at = ((u64)t * kv_heads + kvh) * head_dim + lane;
        float dot = 0.f;
#pragma unroll
        for (int j = 0; j < PER_LANE; ++j)
            if (j < n) dot = fmaf(qv[j], k[at + 32 * j], dot);
        const float s = warp_sum(dot) * scale;
        const float m_new = fmaxf(m, s);
        const float correction = expf(m - m_new), p = expf(s - m_new);
        l = l * correction + p;
#pragma unroll
        for (int j = 0; j < PER_LANE; ++j)
            if (j < n) acc[j] = fmaf(p, v[at + 32 * j], acc[j] * correction);
        m = m_new;
    }
    if (l == 0.f) return;

    const float block_lse = m + logf(l), inv_l = 1.f / l;
    const float old_lse = lse[cell];
    float wa = 0.f, wb = 1.f, inv = 1.f, merged = block_lse;
    if (old_lse != NEG_INF) {
        const float M = fmaxf(old_lse, block_lse);
        wa = expf(old_lse - M);
        wb = expf(block_lse - M);
        inv = 1.f / (wa + wb);
        merged = M + logf(wa + wb);
    }
    float* out = o + cell * head_dim + lane;
#pragma unroll
    for (int j = 0; j < PER_LANE; ++j)
        if (j < n) {
            const float b = acc[j] * inv_l;
            out[32 * j] = old_lse == NEG_INF ? b : (out[32 * j] * wa + b * wb) * inv;
        }
    if (lane == 0) lse[cell] = merged;
}

// GEMV: `out[m][n] = x[m] · w[n]` for the few rows m < rows <= GEMV_MAX_ROWS of a decode step,
// the weight streamed once at close to the memory's bandwidth (cuBLAS's GEMMs for a handful of
// rows split k and reduce in a second kernel).
//
// `slices` warps (1, 2, 4 or 8, the host's choice) share an output column, GEMV_WARPS per CTA:
// the warps of a column take turns along k in runs of 32 16-byte chunks of the weight (8
// elements of a 16-bit weight, 4 of an f32 one), one chunk per lane. Cutting k into slices gives
// a matrix of few columns enough warps to fill the GPU. Each warp loads GEMV_UNROLL runs before
// it multiplies any, so every lane keeps that many loads in flight. (Loading the next runs while
// multiplying these, in a second set of registers, measured slower on an H100: fewer warps fit.)
// The slices' sums meet in shared memory and are added in slice
// order, so the result does not depend on timing. The weight is read once, so its loads skip
// L1; the activations are read by every warp and stay in L1. A 16-bit weight meets its
// activation rounded to its own dtype, as a cuBLAS GEMM on the rounded copy would; sums are fp32.
// The host checks that k is a whole number of chunks and that the buffers are 16-byte aligned.
//
// The epilogue is the output's: `gemv` stores, `gemv_add` adds into the output (a residual
// connection), `gemv_swiglu` computes columns n and n + cols of a fused gate|up weight and stores
// silu(gate) * up.
#define GEMV_UNROLL 4
#define GEMV_VEC (16 / (int)sizeof(elem_t))

__device__ __forceinline__ void unpack(const uint4 c, float (&f)[GEMV_VEC]) {
#if CANOPY_DTYPE == 0
    f[0] = __uint_as_float(c.x);
    f[1] = __uint_as_float(c.y);
    f[2] = __uint_as_float(c.z);
    f[3] = __uint_as_float(c.w);
#else
    const u32 words[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        f[2 * i] = widen((u16)(words[i] & 0xffffu));
        f[2 * i + 1] = widen((u16)(words[i] >> 16));
    }
#endif
}

// The activation as the weight's dtype sees it.
__device__ __forceinline__ float as_operand(float x) {
#if CANOPY_DTYPE == 0
    return x;
#else
    return widen(narrow(x));
#endif
}

__device__ __forceinline__ uint4 load_streamed(const uint4* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}

// The CTA's column for this warp (`n`, past the output when `n >= cols`) and its slice.
struct GemvColumn {
    u32 n;
    u32 slice;
};

__device__ __forceinline__ GemvColumn gemv_column(u32 slices) {
    const u32 warp = threadIdx.x / 32;
    return {blockIdx.x * (GEMV_WARPS / slices) + warp / slices, warp % slices};
}

// The GEMV_UNROLL runs of chunks from `base` (zeros past the row's end).
template <int COLS>
__device__ __forceinline__ void gemv_load(const elem_t* __restrict__ w, u32 k, u32 chunks, u32 base, u32 stride,
                                          const u64 (&w_rows)[COLS], uint4 (&wc)[GEMV_UNROLL][COLS]) {
    const u32 lane = threadIdx.x % 32;
#pragma unroll
    for (int u = 0; u < GEMV_UNROLL; ++u) {
        const u32 c = base + u * stride + lane;
#pragma unroll
        for (int j = 0; j < COLS; ++j)
            wc[u][j] = c < chunks ? load_streamed(reinterpret_cast<const uint4*>(w + w_rows[j] * k) + c)
                                  : make_uint4(0u, 0u, 0u, 0u);
    }
}

// acc[m][j] = x[m] · w[w_rows[j]] for COLS weight rows at once, summed over the column's warps;
// the sums are valid in the column's slice-0 warp. Every thread of the CTA must call it (it
// synchronizes the CTA); a warp whose column is past the output (`active` false) loads nothing.
template <int COLS>
__device__ __forceinline__ void gemv_dots(const elem_t* __restrict__ w, const float* __restrict__ x,
                                          u32 rows, u32 k, bool active, u32 slices, u32 slice,
                                          const u64 (&w_rows)[COLS], float (&acc)[GEMV_MAX_ROWS][COLS]) {
    __shared__ float partial[GEMV_WARPS][GEMV_MAX_ROWS][COLS];
    const u32 lane = threadIdx.x % 32;
    const u32 chunks = active ? k / GEMV_VEC : 0;
    const u32 stride = 32 * slices, step = stride * GEMV_UNROLL;
    for (u32 base = slice * 32; base < chunks; base += step) {
        uint4 wc[GEMV_UNROLL][COLS];
        gemv_load<COLS>(w, k, chunks, base, stride, w_rows, wc);
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; ++u) {
            const u32 c = base + u * stride + lane;
            if (c >= chunks) break;
            float wf[COLS][GEMV_VEC];
#pragma unroll
            for (int j = 0; j < COLS; ++j) unpack(wc[u][j], wf[j]);
#pragma unroll
            for (int m = 0; m < GEMV_MAX_ROWS; ++m) {
                if (m >= (int)rows) break;
                const float4* xm = reinterpret_cast<const float4*>(x + (u64)m * k + (u64)c * GEMV_VEC);
                float xv[GEMV_VEC];
#pragma unroll
                for (int e = 0; e < GEMV_VEC / 4; ++e) {
                    const float4 t = __ldg(xm + e);
                    xv[4 * e] = as_operand(t.x);
                    xv[4 * e + 1] = as_operand(t.y);
                    xv[4 * e + 2] = as_operand(t.z);
                    xv[4 * e + 3] = as_operand(t.w);
                }
#pragma unroll
                for (int j = 0; j < COLS; ++j)
#pragma unroll
                    for (int e = 0; e < GEMV_VEC; ++e) acc[m][j] = fmaf(wf[j][e], xv[e], acc[m][j]);
            }
        }
    }
    const u32 warp = threadIdx.x / 32;
#pragma unroll
    for (int m = 0; m < GEMV_MAX_ROWS; ++m)
#pragma unroll
        for (int j = 0; j < COLS; ++j) {
            const float sum = warp_sum(acc[m][j]);
            if (lane == 0) partial[warp][m][j] = sum;
        }
    __syncthreads();
    if (slice == 0 && lane == 0)
#pragma unroll
        for (int m = 0; m < GEMV_MAX_ROWS; ++m)
#pragma unroll
            for (int j = 0; j < COLS; ++j) {
                float sum = 0.f;
                for (u32 s = 0; s < slices; ++s) sum += partial[warp + s][m][j];
                acc[m][j] = sum;
            }
}

// Whether this thread writes its column's outputs: lane 0 of the column's slice-0 warp.
#define GEMV_WRITER(col) ((col).n < cols && (col).slice == 0 && threadIdx.x % 32 == 0)

extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv(const elem_t* __restrict__ w, const float* __restrict__ x, float* __restrict__ out, u32 rows, u32 cols,
     u32 k, u32 slices) {
    const GemvColumn col = gemv_column(slices);
    const u64 w_rows[1] = {col.n};
    float acc[GEMV_MAX_ROWS][1] = {};
    gemv_dots<1>(w, x, rows, k, col.n < cols, slices, col.slice, w_rows, acc);
    if (GEMV_WRITER(col))
        for (u32 m = 0; m < rows; ++m) out[(u64)m * cols + col.n] = acc[m][0];
}

extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_add(const elem_t* __restrict__ w, const float* __restrict__ x, float* __restrict__ out, u32 rows,
         u32 cols, u32 k, u32 slices) {
    const GemvColumn col = gemv_column(slices);
    const u64 w_rows[1] = {col.n};
    float acc[GEMV_MAX_ROWS][1] = {};
    gemv_dots<1>(w, x, rows, k, col.n < cols, slices, col.slice, w_rows, acc);
    if (GEMV_WRITER(col))
        for (u32 m = 0; m < rows; ++m) out[(u64)m * cols + col.n] += acc[m][0];
}

// `cols` is the output's width: the weight has 2 * cols rows, gate's then up's.
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_swiglu(const elem_t* __restrict__ w, const float* __restrict__ x, float* __restrict__ out, u32 rows,
            u32 cols, u32 k, u32 slices) {
    const GemvColumn col = gemv_column(slices);
    const u64 w_rows[2] = {col.n, (u64)cols + col.n};
    float acc[GEMV_MAX_ROWS][2] = {};
    gemv_dots<2>(w, x, rows, k, col.n < cols, slices, col.slice, w_rows, acc);
    if (GEMV_WRITER(col))
        for (u32 m = 0; m < rows; ++m) {
            const float g = acc[m][0];
            out[(u64)m * cols + col.n] = g / (1.f + expf(-g)) * acc[m][1];
        }
}
