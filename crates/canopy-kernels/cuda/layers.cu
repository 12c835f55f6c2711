// The dense half of a transformer layer (canopy_engine::LayerOps on the CUDA backend).
//
// Activations are fp32 row-major matrices; weights and KV are stored as CANOPY_DTYPE (`elem_t`:
// f32, f16 or bf16) and widened to fp32 on load, so every kernel's arithmetic is fp32. The
// GEMMs are cuBLAS's; these kernels are what surrounds them: rounding activations to the
// weights' dtype for a 16-bit GEMM (RMSNorm and SwiGLU also write that rounded copy beside
// their output when the host gives them one), the embedding gather, RMSNorm, RoPE (splitting a
// fused q|k|v projection, and appending the keys and values to the KV cache in the same
// kernel), SwiGLU, the KV store by (row, slot) pairs, and attention of a block of query rows
// over a block of keys. A projection of a few rows (a decode step) is not cuBLAS's
// but `gemv`'s, which streams the weight once at close to the memory's bandwidth and folds the
// residual add or SwiGLU into its output.
//
// The element-wise kernels are grid-stride loops over LAYER_THREADS-thread CTAs, so any grid
// covers any size. Every op follows transformers' Llama in fp32, but for the gate|up product
// of a 16-bit GEMM, which cuBLAS stores in the weights' dtype as a 16-bit model does
// (`swiglu_narrow` reads it); accurate libm calls (expf, sincosf, logf; no fast-math) keep them
// within rounding of the host's f32 ops.

#ifndef LAYER_THREADS
#error "LAYER_THREADS must be defined by the kernel registry"
#endif
#ifndef ATTENTION_MAX_HEAD_DIM
#error "ATTENTION_MAX_HEAD_DIM must be defined by the kernel registry"
#endif
#ifndef GEMV_WARPS
#error "GEMV_WARPS must be defined by the kernel registry"
#endif
#ifndef GEMV_COLS
#error "GEMV_COLS must be defined by the kernel registry"
#endif
#ifndef GEMV_MAX_ROWS
#error "GEMV_MAX_ROWS must be defined by the kernel registry"
#endif
#ifndef CAUSAL_ROWS
#error "CAUSAL_ROWS must be defined by the kernel registry"
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

// i / width and i % width, in 32 bits while i fits them: the element-wise kernels divide once an
// element, and a 64-bit division is a long software sequence (it bound RoPE's kernel).
struct RowCol {
    u64 row;
    u32 col;
};
__device__ __forceinline__ RowCol row_col(u64 i, u32 width) {
    if (i <= 0xffffffffull) {
        const u32 r = (u32)i / width;
        return {r, (u32)i - r * width};
    }
    return {i / width, (u32)(i % width)};
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int o = 16; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

// `out = x` rounded to the weights' dtype: a 16-bit GEMM's activation operand; x is also
// copied to `copy` unless it is null.
extern "C" __global__ void round_to_elem(const float* __restrict__ x, float* __restrict__ copy,
                                         elem_t* __restrict__ out, u64 n) {
    GRID_STRIDE(i, n) {
        const float v = x[i];
        if (copy) copy[i] = v;
        out[i] = narrow(v);
    }
}

// `out[r] = table[ids[r]]`, widened (the host has checked every id against the table).
extern "C" __global__ void embed_rows(const elem_t* __restrict__ table, const u32* __restrict__ ids,
                                      float* __restrict__ out, u32 rows, u32 cols) {
    GRID_STRIDE(i, (u64)rows * cols) {
        const RowCol at = row_col(i, cols);
        out[i] = widen(table[(u64)ids[at.row] * cols + at.col]);
    }
}

// 1 / sqrt(mean(x²) + eps) of `row` (cols floats) over a CTA of LAYER_THREADS threads, each
// thread's float4s of a row it holds (`held`: row_held) left in `v`. rms_norm and the GEMVs
// that normalise their activation (`gemv_normed`) share this one order of operations, so both
// give the same bits. `warp_sums` is LAYER_THREADS / 32 floats of shared memory, free again on
// return.
__device__ __forceinline__ float row_inv_rms(const float* __restrict__ row, u32 cols, float eps, bool held,
                                             float4 (&v)[RMS_NORM_CHUNKS], float* warp_sums) {
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
    __syncthreads();
    return inv;
}

// Whether a row of `cols` is read once into registers (row_inv_rms's `held`).
__device__ __forceinline__ bool row_held(u32 cols) {
    return cols % 4 == 0 && cols <= 4u * LAYER_THREADS * RMS_NORM_CHUNKS;
}

// One CTA per row: `out = w * (x / sqrt(mean(x²) + eps))`, the host's order of operations,
// and, unless `rounded` is null, out rounded to the weights' dtype (the operand of the GEMM
// that reads it). `out` may be null where the rounded copy is all that is read. A row of up to RMS_NORM_CHUNKS float4s per thread is read once into
// registers, every load in flight at once (a decode step's single row is a chain of latencies
// otherwise); a longer or unaligned row is read twice.
extern "C" __global__ void __launch_bounds__(LAYER_THREADS)
rms_norm(const float* __restrict__ x, const elem_t* __restrict__ w, float* __restrict__ out,
         elem_t* __restrict__ rounded, u32 cols, float eps) {
    let_next_grid_launch();
    wait_for_previous_grid();
    __shared__ float warp_sums[LAYER_THREADS / 32];
    const float* row = x + (u64)blockIdx.x * cols;
    float* dst = out ? out + (u64)blockIdx.x * cols : nullptr;
    elem_t* low = rounded ? rounded + (u64)blockIdx.x * cols : nullptr;
    const bool held = row_held(cols);
    float4 v[RMS_NORM_CHUNKS];
    const float inv = row_inv_rms(row, cols, eps, held, v, warp_sums);
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
                if (dst) reinterpret_cast<float4*>(dst)[c] = o;
                if (low) {
                    low[4 * c] = narrow(o.x);
                    low[4 * c + 1] = narrow(o.y);
                    low[4 * c + 2] = narrow(o.z);
                    low[4 * c + 3] = narrow(o.w);
                }
            }
        }
    } else {
        for (u32 c = threadIdx.x; c < cols; c += LAYER_THREADS) {
            const float y = widen(w[c]) * (row[c] * inv);
            if (dst) dst[c] = y;
            if (low) low[c] = narrow(y);
        }
    }
}

// The pair (x1, x2) of a head rotated by the angle whose sine and cosine are s and c
// (rotate_half's convention): the one expression both RoPE kernels use, so a key stored by
// `rope_split_store` is bit for bit the one `rope_split` writes.
__device__ __forceinline__ float2 rotate_pair(float x1, float x2, float s, float c) {
    return make_float2(x1 * c - x2 * s, x2 * c + x1 * s);
}

// Sine and cosine of row r's RoPE angle for pair j of a head: positions[r] * inv_freq[j], in
// fp32.
__device__ __forceinline__ float2 rope_angle(const u32* __restrict__ positions, const float* __restrict__ inv_freq,
                                             u64 r, u32 j) {
    float s, c;
    sincosf((float)positions[r] * inv_freq[j], &s, &c);
    return make_float2(s, c);
}

// The angle of item i of `rope_split_rows`' pairs (`pairs` a row, `half` a head).
__device__ __forceinline__ float2 split_angle(const u32* __restrict__ positions, const float* __restrict__ inv_freq,
                                              u64 i, u32 pairs, u32 half) {
    const RowCol at = row_col(i, pairs);
    return rope_angle(positions, inv_freq, at.row, at.col % half);
}

// The angle of item i of `rope_split_store`'s stored keys (`kv_pairs` a row).
__device__ __forceinline__ float2 store_angle(const u32* __restrict__ positions, const float* __restrict__ inv_freq,
                                              const u32* __restrict__ pairs, u64 i, u32 kv_pairs, u32 half) {
    const RowCol at = row_col(i, kv_pairs);
    return rope_angle(positions, inv_freq, pairs[2 * at.row], at.col % half);
}

// The RoPE kernels launch as programmatic dependents of the projection that writes qkv. Their
// positions, frequencies and (row, slot) pairs are no kernel's output, so each thread takes
// the angle of its first item (index `first`: the grid-stride loops' first) before it waits,
// while the projection still runs: sincosf of a large angle is a long computation.
__device__ __forceinline__ u64 first_item() { return blockIdx.x * (u64)blockDim.x + threadIdx.x; }

// Splits each row of a fused projection `qkv` (`q_cols | kv_cols | kv_cols`) into q, k and v,
// rotating every head (2 * half columns) of q and k by positions[r] (rotate_half): one thread
// per pair (i, i + half) of a q or k head, angle positions[r] * inv_freq[i] in fp32, then one
// per element of v. `first` is the angle of the thread's first pair, if it has one.
__device__ __forceinline__ void rope_split_rows(const float* __restrict__ qkv, const u32* __restrict__ positions,
                                                const float* __restrict__ inv_freq, float* __restrict__ q,
                                                float* __restrict__ k, float* __restrict__ v, u32 rows,
                                                u32 q_cols, u32 kv_cols, u32 half, float2 first) {
    const u32 width = q_cols + 2 * kv_cols, pairs = (q_cols + kv_cols) / 2;
    GRID_STRIDE(i, (u64)rows * pairs) {
        const RowCol at = row_col(i, pairs);
        const u64 r = at.row;
        const u32 p = at.col, head = p / half, j = p - head * half;
        const float2 sc = i == first_item() ? first : rope_angle(positions, inv_freq, r, j);
        const u32 col = head * 2 * half;
        const float* h = qkv + r * width + col;
        const float2 rotated = rotate_pair(h[j], h[j + half], sc.x, sc.y);
        float* dst = col < q_cols ? q + r * q_cols + col : k + r * kv_cols + (col - q_cols);
        dst[j] = rotated.x;
        dst[j + half] = rotated.y;
    }
    GRID_STRIDE(i, (u64)rows * kv_cols) {
        const RowCol at = row_col(i, kv_cols);
        v[i] = qkv[at.row * width + q_cols + kv_cols + at.col];
    }
}

extern "C" __global__ void rope_split(const float* __restrict__ qkv, const u32* __restrict__ positions,
                                      const float* __restrict__ inv_freq, float* __restrict__ q,
                                      float* __restrict__ k, float* __restrict__ v, u32 rows,
                                      u32 q_cols, u32 kv_cols, u32 half) {
    let_next_grid_launch();
    const u32 pairs = (q_cols + kv_cols) / 2;
    const float2 first = first_item() < (u64)rows * pairs ? split_angle(positions, inv_freq, first_item(), pairs, half)
                                                          : make_float2(0.f, 1.f);
    wait_for_previous_grid();
    rope_split_rows(qkv, positions, inv_freq, q, k, v, rows, q_cols, kv_cols, half, first);
}

// `rope_split`, and for each of `count` (row, slot) pairs that row's rotated key and its value
// written into physical token `slot` of the KV pool, narrowed to the KV's dtype: RoPE fused
// into the KV append. The stored key is rotated again from qkv (no thread waits for another's
// k), with rope_split's expression, so it is what store_kv would store from k. The host has
// checked every row and slot.
extern "C" __global__ void rope_split_store(const float* __restrict__ qkv, const u32* __restrict__ positions,
                                            const float* __restrict__ inv_freq, float* __restrict__ q,
                                            float* __restrict__ k, float* __restrict__ v, u32 rows,
                                            u32 q_cols, u32 kv_cols, u32 half, const u32* __restrict__ pairs,
                                            elem_t* __restrict__ kc, elem_t* __restrict__ vc, u32 count) {
    let_next_grid_launch();
    const u32 width = q_cols + 2 * kv_cols, row_pairs = (q_cols + kv_cols) / 2, kv_pairs = kv_cols / 2;
    const u64 t = first_item();
    const float2 first = t < (u64)rows * row_pairs ? split_angle(positions, inv_freq, t, row_pairs, half)
                                                   : make_float2(0.f, 1.f);
    const float2 first_stored = t < (u64)count * kv_pairs ? store_angle(positions, inv_freq, pairs, t, kv_pairs, half)
                                                          : make_float2(0.f, 1.f);
    wait_for_previous_grid();
    rope_split_rows(qkv, positions, inv_freq, q, k, v, rows, q_cols, kv_cols, half, first);
    GRID_STRIDE(i, (u64)count * kv_pairs) {
        const RowCol at = row_col(i, kv_pairs);
        const u64 p = at.row;
        const u32 pair = at.col, head = pair / half, j = pair - head * half;
        const u32 row = pairs[2 * p];
        const float2 sc = i == t ? first_stored : rope_angle(positions, inv_freq, row, j);
        const float* h = qkv + (u64)row * width + q_cols + head * 2 * half;
        const float2 rotated = rotate_pair(h[j], h[j + half], sc.x, sc.y);
        elem_t* dst = kc + (u64)pairs[2 * p + 1] * kv_cols + head * 2 * half;
        dst[j] = narrow(rotated.x);
        dst[j + half] = narrow(rotated.y);
    }
    GRID_STRIDE(i, (u64)count * kv_cols) {
        const RowCol at = row_col(i, kv_cols);
        const u64 p = at.row, c = at.col;
        vc[(u64)pairs[2 * p + 1] * kv_cols + c] = narrow(qkv[(u64)pairs[2 * p] * width + q_cols + kv_cols + c]);
    }
}

// silu(g) * u, as transformers' Llama MLP computes it: every SwiGLU here, and the GEMV's.
__device__ __forceinline__ float silu_mul(float g, float u) { return g / (1.f + expf(-g)) * u; }

// `out = silu(gate) * up`, gate and up the two halves of each row of `gate_up` (`rows × 2
// cols`): the SwiGLU of a fused gate|up projection; and, unless `rounded` is null, out rounded
// to the weights' dtype (the operand of the GEMM that reads it). `out` may be null where the
// rounded copy is all that is read.
extern "C" __global__ void swiglu(const float* __restrict__ gate_up, float* __restrict__ out,
                                  elem_t* __restrict__ rounded, u32 rows, u32 cols) {
    GRID_STRIDE(i, (u64)rows * cols) {
        const RowCol at = row_col(i, cols);
        const u64 r = at.row, c = at.col;
        const float y = silu_mul(gate_up[r * 2 * cols + c], gate_up[r * 2 * cols + cols + c]);
        if (out) out[i] = y;
        if (rounded) rounded[i] = narrow(y);
    }
}

// `swiglu` of a gate|up product held in the weights' dtype (a 16-bit GEMM's output, as a
// 16-bit model keeps it): eight columns a thread with 16-byte loads where `cols` is a multiple
// of 8, else one. `out` may be null, as swiglu's.
extern "C" __global__ void swiglu_narrow(const elem_t* __restrict__ gate_up, float* __restrict__ out,
                                         elem_t* __restrict__ rounded, u32 rows, u32 cols) {
    if (cols % 8 != 0) {
        GRID_STRIDE(i, (u64)rows * cols) {
            const RowCol at = row_col(i, cols);
            const u64 r = at.row, c = at.col;
            const float y = silu_mul(widen(gate_up[r * 2 * cols + c]), widen(gate_up[r * 2 * cols + cols + c]));
            if (out) out[i] = y;
            if (rounded) rounded[i] = narrow(y);
        }
        return;
    }
    const u32 groups = cols / 8;
    GRID_STRIDE(i, (u64)rows * groups) {
        const RowCol group = row_col(i, groups);
        const u64 r = group.row, c = (u64)group.col * 8, at = r * cols + c;
        const Raw8* row = reinterpret_cast<const Raw8*>(gate_up + r * 2 * cols + c);
        float g[8], u[8], y[8];
        widen8(row[0], g);
        widen8(row[groups], u);
#pragma unroll
        for (int e = 0; e < 8; ++e) y[e] = silu_mul(g[e], u[e]);
        if (out) {
            float4* o = reinterpret_cast<float4*>(out + at);
            o[0] = make_float4(y[0], y[1], y[2], y[3]);
            o[1] = make_float4(y[4], y[5], y[6], y[7]);
        }
        if (rounded) {
#if CANOPY_DTYPE == 0
#pragma unroll
            for (int e = 0; e < 8; ++e) rounded[at + e] = y[e];
#else
            u32 packed[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) packed[e] = (u32)narrow(y[2 * e]) | (u32)narrow(y[2 * e + 1]) << 16;
            *reinterpret_cast<uint4*>(rounded + at) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
#endif
        }
    }
}

// For each of `count` (row, slot) pairs, row `row` of k and v (`width` values) into physical
// token slot `slot` of the KV pool, narrowed to the KV's dtype (the host has checked every row
// against k and v and every slot against the pool).
extern "C" __global__ void store_kv(const float* __restrict__ k, const float* __restrict__ v,
                                    const u32* __restrict__ pairs, elem_t* __restrict__ kc,
                                    elem_t* __restrict__ vc, u32 count, u32 width) {
    let_next_grid_launch();
    wait_for_previous_grid();
    GRID_STRIDE(i, (u64)count * width) {
        const RowCol at = row_col(i, width);
        const u64 p = at.row, c = at.col;
        const u64 from = (u64)pairs[2 * p] * width + c, to = (u64)pairs[2 * p + 1] * width + c;
        kc[to] = narrow(k[from]);
        vc[to] = narrow(v[from]);
    }
}

// For each of `count` slots, physical token `slots[i]` of the KV pool (`width` values) widened
// into row i of k and v: store_kv's inverse, for attention that reads keys where the cache keeps
// them (the host has checked every slot against the pool).
extern "C" __global__ void load_kv(const elem_t* __restrict__ kc, const elem_t* __restrict__ vc,
                                   const u32* __restrict__ slots, float* __restrict__ k,
                                   float* __restrict__ v, u32 count, u32 width) {
    GRID_STRIDE(i, (u64)count * width) {
        const RowCol at = row_col(i, width);
        const u64 from = (u64)slots[at.row] * width + at.col;
        k[i] = widen(kc[from]);
        v[i] = widen(vc[from]);
    }
}

// Attention of query rows over one block of keys, merged into the rows' states, the keys and
// values read rounded to the module's dtype (as a KV cache of it holds them).
//
// One warp per CAUSAL_ROWS consecutive rows of one head, LAYER_THREADS / 32 warps per CTA; lane
// l holds elements l + 32 j of each row's query and output. The warp walks the block's keys in
// order, loading each key and value once for its rows (the rows share the head's K and V, so
// the block is read rows / CAUSAL_ROWS times, not once per row), and skips for each row the
// keys after its position and, with `q_from` (else null), those before q_from[row]
// (warp-uniform tests), with an online softmax per row in fp32 on the natural-log scale. Each
// row's block state (o normalised, lse) then merges into the existing one exactly as
// canopy_core::merge_state does: a block with no visible key leaves it as it is, and an empty
// state (lse = -inf) takes the block's as it is, so an empty never meets `-inf - -inf`.
extern "C" __global__ void __launch_bounds__(LAYER_THREADS)
causal_attention(const float* __restrict__ q, const u32* __restrict__ q_pos, const u32* __restrict__ q_from,
                 const float* __restrict__ k,
                 const float* __restrict__ v, const u32* __restrict__ k_pos, u32 tokens,
                 float* __restrict__ o, float* __restrict__ lse, u32 rows, u32 q_heads, u32 kv_heads,
                 u32 head_dim, float scale) {
    constexpr int PER_LANE = ATTENTION_MAX_HEAD_DIM / 32;
    const int lane = threadIdx.x % 32;
    const u64 unit = (u64)blockIdx.x * (LAYER_THREADS / 32) + threadIdx.x / 32;
    const u32 row_groups = (rows + CAUSAL_ROWS - 1) / CAUSAL_ROWS;
    if (unit >= (u64)row_groups * q_heads) return;
    const u32 first_row = (u32)(unit / q_heads) * CAUSAL_ROWS, head = (u32)(unit % q_heads);
    const u32 kvh = head / (q_heads / kv_heads);
    const int n = (int)(head_dim / 32);

    bool live[CAUSAL_ROWS];
    u32 pos[CAUSAL_ROWS], from[CAUSAL_ROWS], last = 0, first = 0xffffffffu;
    float qv[CAUSAL_ROWS][PER_LANE], acc[CAUSAL_ROWS][PER_LANE], m[CAUSAL_ROWS], l[CAUSAL_ROWS];
#pragma unroll
    for (int r = 0; r < CAUSAL_ROWS; ++r) {
        const u32 row = first_row + r;
        live[r] = row < rows;
        pos[r] = live[r] ? q_pos[row] : 0;
        from[r] = live[r] && q_from ? q_from[row] : 0;
        if (live[r]) {
            last = max(last, pos[r]);
            first = min(first, from[r]);
        }
        const u64 cell = (u64)row * q_heads + head;
#pragma unroll
        for (int j = 0; j < PER_LANE; ++j) {
            qv[r][j] = live[r] && j < n ? q[cell * head_dim + lane + 32 * j] : 0.f;
            acc[r][j] = 0.f;
        }
        m[r] = NEG_INF;
        l[r] = 0.f;
    }
    for (u32 t = 0; t < tokens; ++t) {
        const u32 key_pos = k_pos[t];
        if (key_pos > last || key_pos < first) continue;
        const u64 at = ((u64)t * kv_heads + kvh) * head_dim + lane;
        float kt[PER_LANE], vt[PER_LANE];
#pragma unroll
        for (int j = 0; j < PER_LANE; ++j) {
            kt[j] = j < n ? widen(narrow(k[at + 32 * j])) : 0.f;
            vt[j] = j < n ? widen(narrow(v[at + 32 * j])) : 0.f;
        }
#pragma unroll
        for (int r = 0; r < CAUSAL_ROWS; ++r) {
            if (!live[r] || key_pos > pos[r] || key_pos < from[r]) continue;
            float dot = 0.f;
#pragma unroll
            for (int j = 0; j < PER_LANE; ++j)
                if (j < n) dot = fmaf(qv[r][j], kt[j], dot);
            const float s = warp_sum(dot) * scale;
            const float m_new = fmaxf(m[r], s);
            const float correction = expf(m[r] - m_new), p = expf(s - m_new);
            l[r] = l[r] * correction + p;
#pragma unroll
            for (int j = 0; j < PER_LANE; ++j)
                if (j < n) acc[r][j] = fmaf(p, vt[j], acc[r][j] * correction);
            m[r] = m_new;
        }
    }
#pragma unroll
    for (int r = 0; r < CAUSAL_ROWS; ++r) {
        if (!live[r] || l[r] == 0.f) continue;
        const u64 cell = (u64)(first_row + r) * q_heads + head;
        const float block_lse = m[r] + logf(l[r]), inv_l = 1.f / l[r];
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
                const float b = acc[r][j] * inv_l;
                out[32 * j] = old_lse == NEG_INF ? b : (out[32 * j] * wa + b * wb) * inv;
            }
        if (lane == 0) lse[cell] = merged;
    }
}

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
// were slower: BENCHMARKS session 16). Cutting k into slices gives a matrix of
// few columns enough warps to fill the GPU.
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
    const u32 blocks = (k + GEMV_BLOCK - 1) / GEMV_BLOCK, step = slices * GEMV_UNROLL;
    uint4 wc[GEMV_UNROLL][MATS][2];
    gemv_load_blocks<MATS>(w, n, live, mat_offset, k, blocks, slice, slices, wc);
    wait_for_previous_grid();
    if (norm.staged) gemv_stage_normed(x, norm.gamma, norm.eps, rows, k, norm.staged);
#if CANOPY_DTYPE != 0
    // Lane (m, q) = (lane / 4, lane % 4): row m of the activation, columns 2q and 2q + 1 of D.
    const u32 m = lane / 4;
    float acc[MATS][4] = {};
    for (u32 base = slice; base < blocks; base += step) {
        if (base != slice) gemv_load_blocks<MATS>(w, n, live, mat_offset, k, blocks, base, slices, wc);
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; ++u) {
            const u32 block = base + u * slices;
            if (block >= blocks) break;
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
        }
    }
    if (m < rows)
#pragma unroll
        for (int j = 0; j < MATS; ++j) {
            sums[m][2 * (lane % 4)][j] = acc[j][0];
            sums[m][2 * (lane % 4) + 1][j] = acc[j][1];
        }
#else
    float acc[GEMV_MAX_ROWS][MATS] = {};
    for (u32 base = slice; base < blocks; base += step) {
        if (base != slice) gemv_load_blocks<MATS>(w, n, live, mat_offset, k, blocks, base, slices, wc);
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; ++u) {
            const u32 block = base + u * slices;
            if (block >= blocks) break;
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
        }
    }
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

// Runs every warp's sums into shared memory, then calls `epilogue(m, n, sum)` once per output
// (row m, column n < cols) with the slices' sums added in slice order, spread over the CTA.
// With a norm weight `gamma` (else null), the product is of x's rows RMS-normalised: staged
// in the CTA's dynamic shared memory (rows x k elements, at most NORMED_GEMV_ROWS rows).
template <int MATS, typename Epilogue>
__device__ __forceinline__ void gemv_cta(const elem_t* __restrict__ w, const float* __restrict__ x, u32 rows,
                                         u32 cols, u32 k, u32 slices, u64 mat_offset, const elem_t* gamma, float eps,
                                         Epilogue epilogue) {
    static_assert(GEMV_WARPS * 32 == LAYER_THREADS, "a normed GEMV's CTA normalises its rows as rms_norm's does");
    __shared__ float sums[GEMV_WARPS][GEMV_MAX_ROWS][GEMV_COLS][MATS];
    extern __shared__ __align__(16) unsigned char gemv_staged[];
    const u32 warp = threadIdx.x / 32, groups = GEMV_WARPS / slices;
    const u32 first_group = blockIdx.x * groups;
    let_next_grid_launch();
    const GemvNorm norm{gamma, eps, gamma ? reinterpret_cast<elem_t*>(gemv_staged) : nullptr};
    gemv_warp_sums<MATS>(w, x, rows, cols, k, first_group + warp / slices, slices, warp % slices, mat_offset, norm,
                         sums[warp]);
    __syncthreads();
    for (u32 i = threadIdx.x; i < groups * rows * GEMV_COLS; i += blockDim.x) {
        const u32 g = i / (rows * GEMV_COLS), m = i / GEMV_COLS % rows, c = i % GEMV_COLS;
        const u32 n = (first_group + g) * GEMV_COLS + c;
        if (n >= cols) continue;
        float total[MATS];
#pragma unroll
        for (int j = 0; j < MATS; ++j) {
            total[j] = 0.f;
            for (u32 s = 0; s < slices; ++s) total[j] += sums[g * slices + s][m][c][j];
        }
        epilogue(m, n, total);
    }
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

#ifndef TOP_ITEMS
#error "TOP_ITEMS must be defined by the kernel registry"
#endif
#define TOP_SEGMENT (LAYER_THREADS * TOP_ITEMS)

// A token's place in canopy_core::logits' order as one 64-bit key, the larger first: the
// logit's bits folded so that unsigned order is f32::total_cmp's, above the token's
// complement, so that among equal logits the lower token wins. Keys are distinct; 0 is below
// every real one and pads a segment.
__device__ __forceinline__ u64 logit_key(float x, u32 token) {
    u32 b = __float_as_uint(x);
    b = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ((u64)b << 32) | (u64)(0xFFFFFFFFu - token);
}

__device__ __forceinline__ float key_logit(u64 key) {
    const u32 b = (u32)(key >> 32);
    return __uint_as_float((b & 0x80000000u) ? (b & 0x7FFFFFFFu) : ~b);
}

__device__ __forceinline__ u32 key_token(u64 key) { return 0xFFFFFFFFu - (u32)key; }

// One pass of narrowing each row to its k most likely tokens: CTA (segment, row) takes
// entries [segment · TOP_SEGMENT, +TOP_SEGMENT) of the row's n (logits when `from_logits`,
// else the keys of an earlier pass) and finds their k largest keys in k rounds, each the
// block's largest key still held. A pass of several segments writes each segment's keys, in
// order, for the next pass (`keys_out`, rows × segments × k); a pass of one segment writes the
// row's k logits then their tokens as f32 bit patterns (`out`, rows × 2k).
extern "C" __global__ void __launch_bounds__(LAYER_THREADS)
top_logits(const float* __restrict__ logits, const u64* __restrict__ keys_in, u32 n, u32 from_logits,
           u32 k, u64* __restrict__ keys_out, float* __restrict__ out) {
    let_next_grid_launch();
    wait_for_previous_grid();
    const u32 row = blockIdx.y, segment = blockIdx.x;
    u64 key[TOP_ITEMS];
#pragma unroll
    for (int i = 0; i < TOP_ITEMS; ++i) {
        const u32 j = segment * TOP_SEGMENT + i * LAYER_THREADS + threadIdx.x;
        key[i] = 0;
        if (j < n) key[i] = from_logits ? logit_key(logits[(u64)row * n + j], j) : keys_in[(u64)row * n + j];
    }
    __shared__ u64 warp_best[LAYER_THREADS / 32];
    const u32 lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    for (u32 round = 0; round < k; ++round) {
        u64 best = 0;
#pragma unroll
        for (int i = 0; i < TOP_ITEMS; ++i) best = key[i] > best ? key[i] : best;
#pragma unroll
        for (int off = 16; off; off >>= 1) {
            const u64 other = __shfl_xor_sync(0xFFFFFFFFu, best, off);
            best = other > best ? other : best;
        }
        if (lane == 0) warp_best[warp] = best;
        __syncthreads();
        best = warp_best[0];
#pragma unroll
        for (int w = 1; w < LAYER_THREADS / 32; ++w) best = warp_best[w] > best ? warp_best[w] : best;
        __syncthreads();
        // Keys are distinct, so only the holder of the block's largest clears it (a pad of 0
        // cleared again stays 0).
#pragma unroll
        for (int i = 0; i < TOP_ITEMS; ++i) key[i] = key[i] == best ? 0 : key[i];
        if (threadIdx.x == 0) {
            if (gridDim.x == 1) {
                out[(u64)row * 2 * k + round] = key_logit(best);
                out[(u64)row * 2 * k + k + round] = __uint_as_float(key_token(best));
            } else {
                keys_out[((u64)row * gridDim.x + segment) * k + round] = best;
            }
        }
    }
}
