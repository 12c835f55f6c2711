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
    __shared__ float warp_sums[LAYER_THREADS / 32];
    const float* row = x + (u64)blockIdx.x * cols;
    float* dst = out ? out + (u64)blockIdx.x * cols : nullptr;
    elem_t* low = rounded ? rounded + (u64)blockIdx.x * cols : nullptr;
    const bool held = row_held(cols);
    // A held row's norm weights, read before the wait: they are no kernel's output, and read
    // after the row's sum they would add a round trip to memory.
    float gamma[RMS_NORM_CHUNKS][4];
    if (held) {
#pragma unroll
        for (int j = 0; j < RMS_NORM_CHUNKS; ++j) {
            const u32 c = threadIdx.x + j * LAYER_THREADS;
#pragma unroll
            for (int e = 0; e < 4; ++e) gamma[j][e] = c < cols / 4 ? widen(w[4 * c + e]) : 0.f;
        }
    }
    wait_for_previous_grid();
    float4 v[RMS_NORM_CHUNKS];
    const float inv = row_inv_rms(row, cols, eps, held, v, warp_sums);
    if (held) {
#pragma unroll
        for (int j = 0; j < RMS_NORM_CHUNKS; ++j) {
            const u32 c = threadIdx.x + j * LAYER_THREADS;
            if (c < cols / 4) {
                float4 o;
                o.x = gamma[j][0] * (v[j].x * inv);
                o.y = gamma[j][1] * (v[j].y * inv);
                o.z = gamma[j][2] * (v[j].z * inv);
                o.w = gamma[j][3] * (v[j].w * inv);
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

// The index of the thread's first item in a grid-stride loop.
__device__ __forceinline__ u64 first_item() { return blockIdx.x * (u64)blockDim.x + threadIdx.x; }

// A RoPE thread's item: VEC consecutive pairs (j, j + half) of one row, in `chunk` consecutive
// heads. VEC is 4 (16-byte loads and stores) where the host found a head's half width a
// multiple of 4 and the rows 16-byte aligned, else 1. The thread computes its VEC angles once
// and rotates them in every head of its chunk: a row's heads share their angles, and a chunk of
// heads puts enough loads in flight for the kernel to stream at the memory's rate. The host
// chunks the heads so that a few rows still spread over the GPU. Items run the pairs fastest,
// then the chunks, then the rows.
struct RopeItem {
    u64 row;
    u32 pair, first_head, end_head;
};
__device__ __forceinline__ RopeItem rope_item(u64 i, u32 groups, u32 vec, u32 heads, u32 chunk) {
    const u32 chunks = (heads + chunk - 1) / chunk;
    const RowCol at = row_col(i, groups * chunks);
    const u32 c = at.col / groups, first = c * chunk;
    return {at.row, (at.col - c * groups) * vec, first, min(first + chunk, heads)};
}

// The angles of pairs j to j + VEC - 1 of `row`: rope_angle's, as every RoPE kernel's.
template <int VEC>
__device__ __forceinline__ void rope_angles(const u32* __restrict__ positions, const float* __restrict__ inv_freq,
                                            u64 row, u32 j, float2 (&sc)[VEC]) {
#pragma unroll
    for (int t = 0; t < VEC; ++t) sc[t] = rope_angle(positions, inv_freq, row, j + t);
}

template <int VEC> __device__ __forceinline__ void load_vec(const float* __restrict__ p, float (&x)[VEC]) {
    if constexpr (VEC == 4) {
        const float4 v = *reinterpret_cast<const float4*>(p);
        x[0] = v.x, x[1] = v.y, x[2] = v.z, x[3] = v.w;
    } else {
#pragma unroll
        for (int t = 0; t < VEC; ++t) x[t] = p[t];
    }
}

// VEC values stored at p: fp32 as they are (16 bytes at once where VEC is 4), any other type
// narrowed to the KV's dtype.
template <typename T> struct IsF32 { static constexpr bool value = false; };
template <> struct IsF32<float> { static constexpr bool value = true; };
template <int VEC, typename T> __device__ __forceinline__ void store_vec(T* __restrict__ p, const float (&x)[VEC]) {
    if constexpr (IsF32<T>::value && VEC == 4) {
        *reinterpret_cast<float4*>(p) = make_float4(x[0], x[1], x[2], x[3]);
    } else if constexpr (IsF32<T>::value) {
#pragma unroll
        for (int t = 0; t < VEC; ++t) p[t] = x[t];
    } else {
#pragma unroll
        for (int t = 0; t < VEC; ++t) p[t] = narrow(x[t]);
    }
}

// One head's VEC pairs from `h` (the head's first column) rotated into `dst` (the same place of
// the output's head).
template <int VEC, typename Out>
__device__ __forceinline__ void rotate_head(const float* __restrict__ h, Out* __restrict__ dst, u32 j, u32 half,
                                            const float2 (&sc)[VEC]) {
    float x1[VEC], x2[VEC], y1[VEC], y2[VEC];
    load_vec<VEC>(h + j, x1);
    load_vec<VEC>(h + j + half, x2);
#pragma unroll
    for (int t = 0; t < VEC; ++t) {
        const float2 r = rotate_pair(x1[t], x2[t], sc[t].x, sc[t].y);
        y1[t] = r.x, y2[t] = r.y;
    }
    store_vec<VEC>(dst + j, y1);
    store_vec<VEC>(dst + j + half, y2);
}

// The geometry both RoPE kernels take: a fused projection `qkv` (`q_cols | kv_cols | kv_cols` a
// row), heads of 2 * half columns, `chunk` heads an item, pairs VEC at a time.
struct RopeShape {
    u32 rows, q_cols, kv_cols, half, chunk;
    __device__ __forceinline__ u32 width() const { return q_cols + 2 * kv_cols; }
    __device__ __forceinline__ u32 heads() const { return (q_cols + kv_cols) / (2 * half); }
    __device__ __forceinline__ u32 kv_heads() const { return kv_cols / (2 * half); }
};

// A RoPE kernel's items, four kinds in one flat range, in this order: q's and k's heads rotated
// (`rotated`, `chunk` heads an item), v copied (`copied`), and for a kernel that appends to the
// KV cache, the stored rows' keys rotated into the pool (`stored_rotated`, `stored.chunk` KV
// heads an item) and their values copied (`stored_copied`). Every item reads only qkv and
// writes a place no other item writes, so a thread may take any item of any kind: at a decode
// step's few rows each thread takes one, and the kinds' loads are all in flight together
// instead of one kind after another.
struct RopeItems {
    u64 rotated, copied, stored_rotated, stored_copied;
    __device__ __forceinline__ u64 total() const { return rotated + copied + stored_rotated + stored_copied; }
};

template <int VEC>
__device__ __forceinline__ RopeItems rope_items(const RopeShape& g, const RopeShape& stored) {
    const u32 groups = g.half / VEC;
    const u32 kv_heads = g.kv_heads();
    return {(u64)g.rows * groups * ((g.heads() + g.chunk - 1) / g.chunk), (u64)g.rows * (g.kv_cols / VEC),
            (u64)stored.rows * groups * ((kv_heads + stored.chunk - 1) / stored.chunk),
            (u64)stored.rows * (g.kv_cols / VEC)};
}

// The angles of item i where it rotates (its row's position, its pairs; rope_angle's, as every
// RoPE kernel's), else those of angle 0.
template <int VEC>
__device__ __forceinline__ void item_angles(u64 i, const RopeItems& n, const u32* __restrict__ positions,
                                            const float* __restrict__ inv_freq, const u32* __restrict__ pairs,
                                            const RopeShape& g, const RopeShape& stored, float2 (&sc)[VEC]) {
    const u32 groups = g.half / VEC;
#pragma unroll
    for (int t = 0; t < VEC; ++t) sc[t] = make_float2(0.f, 1.f);
    if (i < n.rotated) {
        const RopeItem it = rope_item(i, groups, VEC, g.heads(), g.chunk);
        rope_angles<VEC>(positions, inv_freq, it.row, it.pair, sc);
        return;
    }
    const u64 s = i - n.rotated - n.copied;
    if (i >= n.rotated + n.copied && s < n.stored_rotated) {
        const RopeItem it = rope_item(s, groups, VEC, g.kv_heads(), stored.chunk);
        rope_angles<VEC>(positions, inv_freq, pairs[2 * it.row], it.pair, sc);
    }
}

// Splits each row of `qkv` into q, k and v, rotating every head of q and k by positions[r]
// (rotate_half), angle positions[r] * inv_freq[j] in fp32, and copying v; with `pairs` (else
// null), for each of `stored.rows` (row, slot) pairs that row's rotated key and its value
// written into physical token `slot` of the KV pool, narrowed to the KV's dtype: RoPE fused into
// the KV append. The stored key is rotated again from qkv (no thread waits for another's k),
// with the same expression, so it is what store_kv would store from k. Each thread takes the
// angles of its first item before it waits for qkv: sincosf of a large angle is a long
// computation, and positions and frequencies are no kernel's output.
template <int VEC>
__device__ __forceinline__ void rope_kernel(const float* __restrict__ qkv, const u32* __restrict__ positions,
                                            const float* __restrict__ inv_freq, float* __restrict__ q,
                                            float* __restrict__ k, float* __restrict__ v, const RopeShape& g,
                                            const RopeShape& stored, const u32* __restrict__ pairs,
                                            elem_t* __restrict__ kc, elem_t* __restrict__ vc) {
    const RopeItems n = rope_items<VEC>(g, stored);
    float2 first[VEC];
    item_angles<VEC>(first_item(), n, positions, inv_freq, pairs, g, stored, first);
    wait_for_previous_grid();
    const u32 groups = g.half / VEC, width = g.width(), kv_lanes = g.kv_cols / VEC;
    GRID_STRIDE(i, n.total()) {
        float2 sc[VEC];
        if (i == first_item()) {
#pragma unroll
            for (int t = 0; t < VEC; ++t) sc[t] = first[t];
        } else {
            item_angles<VEC>(i, n, positions, inv_freq, pairs, g, stored, sc);
        }
        u64 at = i;
        if (at < n.rotated) {
            const RopeItem it = rope_item(at, groups, VEC, g.heads(), g.chunk);
            for (u32 head = it.first_head; head < it.end_head; ++head) {
                const u32 col = head * 2 * g.half;
                float* dst = col < g.q_cols ? q + it.row * g.q_cols + col : k + it.row * g.kv_cols + (col - g.q_cols);
                rotate_head<VEC>(qkv + it.row * width + col, dst, it.pair, g.half, sc);
            }
            continue;
        }
        at -= n.rotated;
        if (at < n.copied) {
            const RowCol rc = row_col(at, kv_lanes);
            float x[VEC];
            load_vec<VEC>(qkv + rc.row * width + g.q_cols + g.kv_cols + rc.col * VEC, x);
            store_vec<VEC>(v + rc.row * g.kv_cols + rc.col * VEC, x);
            continue;
        }
        at -= n.copied;
        if (at < n.stored_rotated) {
            const RopeItem it = rope_item(at, groups, VEC, g.kv_heads(), stored.chunk);
            const u32 row = pairs[2 * it.row];
            for (u32 head = it.first_head; head < it.end_head; ++head) {
                const u32 col = head * 2 * g.half;
                rotate_head<VEC>(qkv + (u64)row * width + g.q_cols + col,
                                 kc + (u64)pairs[2 * it.row + 1] * g.kv_cols + col, it.pair, g.half, sc);
            }
            continue;
        }
        at -= n.stored_rotated;
        const RowCol rc = row_col(at, kv_lanes);
        const u64 c = (u64)rc.col * VEC;
        float x[VEC];
        load_vec<VEC>(qkv + (u64)pairs[2 * rc.row] * width + g.q_cols + g.kv_cols + c, x);
        store_vec<VEC>(vc + (u64)pairs[2 * rc.row + 1] * g.kv_cols + c, x);
    }
}

// The RoPE kernels launch as programmatic dependents of the projection that writes qkv.
// `rope_split` writes q, k and v only (rope_kernel without pairs).
extern "C" __global__ void rope_split(const float* __restrict__ qkv, const u32* __restrict__ positions,
                                      const float* __restrict__ inv_freq, float* __restrict__ q,
                                      float* __restrict__ k, float* __restrict__ v, u32 rows,
                                      u32 q_cols, u32 kv_cols, u32 half, u32 vec4, u32 chunk) {
    let_next_grid_launch();
    const RopeShape g{rows, q_cols, kv_cols, half, chunk}, none{0, q_cols, kv_cols, half, 1};
    if (vec4)
        rope_kernel<4>(qkv, positions, inv_freq, q, k, v, g, none, nullptr, nullptr, nullptr);
    else
        rope_kernel<1>(qkv, positions, inv_freq, q, k, v, g, none, nullptr, nullptr, nullptr);
}

// `rope_split`, and the keys and values of `count` (row, slot) pairs appended to the KV pool,
// in items of `store_chunk` KV heads (the host has checked every row and slot).
extern "C" __global__ void rope_split_store(const float* __restrict__ qkv, const u32* __restrict__ positions,
                                            const float* __restrict__ inv_freq, float* __restrict__ q,
                                            float* __restrict__ k, float* __restrict__ v, u32 rows,
                                            u32 q_cols, u32 kv_cols, u32 half, u32 vec4, u32 chunk,
                                            const u32* __restrict__ pairs, elem_t* __restrict__ kc,
                                            elem_t* __restrict__ vc, u32 count, u32 store_chunk) {
    let_next_grid_launch();
    const RopeShape g{rows, q_cols, kv_cols, half, chunk}, stored{count, q_cols, kv_cols, half, store_chunk};
    if (vec4)
        rope_kernel<4>(qkv, positions, inv_freq, q, k, v, g, stored, pairs, kc, vc);
    else
        rope_kernel<1>(qkv, positions, inv_freq, q, k, v, g, stored, pairs, kc, vc);
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
