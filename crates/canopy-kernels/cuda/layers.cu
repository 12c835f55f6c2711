// The dense half of a transformer layer (canopy_engine::LayerOps on the CUDA backend).
//
// Activations are fp32 row-major matrices; weights and KV are stored as CANOPY_DTYPE (`elem_t`:
// f32, f16 or bf16) and widened to fp32 on load, so every kernel's arithmetic is fp32. The
// GEMMs are cuBLAS's; these kernels are what surrounds them: rounding activations to the
// weights' dtype for a 16-bit GEMM, the embedding gather, RMSNorm, RoPE, SwiGLU, the residual
// add, the KV store by (row, slot) pairs, and attention of a block of query rows over a block of keys.
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
extern "C" __global__ void __launch_bounds__(LAYER_THREADS)
rms_norm(const float* __restrict__ x, const elem_t* __restrict__ w, float* __restrict__ out, u32 cols,
         float eps) {
    __shared__ float warp_sums[LAYER_THREADS / 32];
    const float* row = x + (u64)blockIdx.x * cols;
    float* dst = out + (u64)blockIdx.x * cols;
    float s = 0.f;
    for (u32 c = threadIdx.x; c < cols; c += LAYER_THREADS) s = fmaf(row[c], row[c], s);
    s = warp_sum(s);
    if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = s;
    __syncthreads();
    s = threadIdx.x < LAYER_THREADS / 32 ? warp_sums[threadIdx.x] : 0.f;
    if (threadIdx.x < 32) s = warp_sum(s);
    if (threadIdx.x == 0) warp_sums[0] = s;
    __syncthreads();
    const float inv = 1.f / sqrtf(warp_sums[0] / (float)cols + eps);
    for (u32 c = threadIdx.x; c < cols; c += LAYER_THREADS) dst[c] = widen(w[c]) * (row[c] * inv);
}

// Rotates each head (2 * half columns) of row r by positions[r] (rotate_half): one thread per
// pair (i, i + half) of a head, angle positions[r] * inv_freq[i] in fp32.
extern "C" __global__ void rope(float* __restrict__ x, const u32* __restrict__ positions,
                                const float* __restrict__ inv_freq, u32 rows, u32 cols, u32 half) {
    const u32 pairs = cols / 2;
    GRID_STRIDE(i, (u64)rows * pairs) {
        const u64 r = i / pairs;
        const u32 p = (u32)(i % pairs), head = p / half, j = p % half;
        float s, c;
        sincosf((float)positions[r] * inv_freq[j], &s, &c);
        float* h = x + r * cols + (u64)head * 2 * half;
        const float x1 = h[j], x2 = h[j + half];
        h[j] = x1 * c - x2 * s;
        h[j + half] = x2 * c + x1 * s;
    }
}

// `gate = silu(gate) * up`.
extern "C" __global__ void swiglu(float* __restrict__ gate, const float* __restrict__ up, u64 n) {
    GRID_STRIDE(i, n) {
        const float g = gate[i];
        gate[i] = g / (1.f + expf(-g)) * up[i];
    }
}

// `acc += x`.
extern "C" __global__ void add_into(float* __restrict__ acc, const float* __restrict__ x, u64 n) {
    GRID_STRIDE(i, n) acc[i] += x[i];
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
