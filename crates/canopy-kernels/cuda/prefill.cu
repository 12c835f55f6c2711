// The prefill's causal attention on tensor cores, for KV in a 16-bit dtype: query rows at
// their positions over one block of keys at theirs, merged into the rows' states. The keys may
// be the rows' own (a prompt's chunk), a chunk from another rank or any earlier block: which key
// a query sees is decided by the positions alone (key position <= query position and, where
// the rows have windows, >= the row's q_from), never by where the block sits, so blocks merge
// exactly in any order.
//
// pack_keys: the block's keys and values (fp32 activations, tokens x kv_heads x HEAD_DIM) to
// the KV dtype, as the cache holds them, head-major and padded with zeros to whole tiles of
// PREFILL_TILE tokens, each tile laid out as prefill_attention's shared memory holds it; and
// each tile's smallest and largest position. gather_keys: the same layout from keys the cache
// holds, at any physical slots.
//
// prefill_attention: FlashAttention's online softmax over tiles of PREFILL_TILE keys. A CTA's
// rows are a block of queries x the GQA heads of one KV head (row r: query q0 + r / gsz, head
// kvh gsz + r % gsz), so each tile of K and V in shared memory serves every head that reads it.
// A tile none of the CTA's queries sees is never loaded (with a prompt's positions in order, a
// block of queries reads the tiles up to its diagonal, and from its windows' first key); a tile
// every query sees whole is not masked; the others are masked score by score. Heavier CTAs
// (later queries) are launched first, so the last wave is of light ones. Each row's result
// merges into its state (o, lse); where the block is every key the rows see and `out` is
// given, the normalised output is stored there instead, rounded to the KV dtype.
//
// On Hopper, heads of 128 run warp-specialised (FlashAttention-3's scheme): one warpgroup
// only copies K and V tiles into PREFILL_WS_STAGES stages with the copy engine (one bulk copy
// a tile, which pack_keys laid out in the warpgroup MMA's 128-byte swizzle), and
// PREFILL_CONSUMERS warpgroups of 64 rows each multiply on the warpgroup MMA (mma.cuh's wg_qk
// and wg_pv) with the registers the copying warpgroup gives up. Each consumer issues the next
// tile's Q K^T before this tile's P V and computes the softmax while both run. Stages are
// handed over by shared-memory barriers, never by the whole CTA.
//
// Elsewhere, four warps of 16 rows multiply with mma.sync and ldmatrix from tiles whose rows
// are padded by MMA_ROW_PAD, streamed through PREFILL_STAGES stages with cp.async.

#ifndef PREFILL_TILE
#error "PREFILL_TILE must be defined by the kernel registry"
#endif
#ifndef PREFILL_STAGES
#error "PREFILL_STAGES must be defined by the kernel registry"
#endif
#ifndef PREFILL_WS_STAGES
#error "PREFILL_WS_STAGES must be defined by the kernel registry"
#endif
#ifndef PREFILL_CONSUMERS
#error "PREFILL_CONSUMERS must be defined by the kernel registry"
#endif
#ifndef PREFILL_WS_TILES
#error "PREFILL_WS_TILES must be defined by the kernel registry"
#endif
#ifndef MMA_THREADS
#error "MMA_THREADS must be defined by the kernel registry"
#endif
#define PIECES (PREFILL_TILE * HEAD_DIM / 8)  // 16-byte pieces of one tile of K (or V)
#define NT (PREFILL_TILE / 8)                 // n-tiles of scores per tile
#if HAS_WGMMA
static_assert(PREFILL_TILE == 64 && MMA_THREADS == 128, "wg_qk multiplies 64 rows by 64 keys");
#define HALF (PREFILL_TILE * 64)              // elements of one 64-wide half of a swizzled tile
#define TILE_BYTES (PREFILL_TILE * HEAD_DIM * 2)  // one tile of K (or V), one bulk copy
#endif

// Where element e (of HEAD_DIM) of token t of KV head `head` lies in the packed keys, whose
// heads hold `padded` tokens each. A tile is contiguous; on Hopper it is two 64-wide halves of
// 128-byte rows, 16-byte piece p of row r at p ^ (r % 8), the swizzle the warpgroup MMA reads.
__device__ __forceinline__ u64 packed_at(u32 head, u32 padded, u32 t, u32 e) {
#if HAS_WGMMA
    const u32 row = t % PREFILL_TILE, piece = e % 64 / 8;
    return ((u64)head * padded + (t - row)) * HEAD_DIM + e / 64 * HALF + row * 64 + ((piece ^ (row % 8)) * 8) + e % 8;
#else
    return ((u64)head * padded + t) * HEAD_DIM + e;
#endif
}

// Tile blockIdx.x's smallest and largest key position into bounds, by the tile's CTA of
// head 0 (its first PREFILL_TILE threads read one key each).
__device__ __forceinline__ void tile_bounds(const u32* __restrict__ k_pos, u32 tokens, u32* __restrict__ bounds) {
    if (blockIdx.y != 0) return;
    const u32 tile = blockIdx.x;
    __shared__ u32 lo, hi;
    if (threadIdx.x == 0) {
        lo = 0xffffffffu;
        hi = 0;
    }
    __syncthreads();
    const u32 t = tile * PREFILL_TILE + threadIdx.x;
    if (threadIdx.x < PREFILL_TILE && t < tokens) {
        atomicMin(&lo, k_pos[t]);
        atomicMax(&hi, k_pos[t]);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        bounds[2 * tile] = lo;
        bounds[2 * tile + 1] = hi;
    }
}

// One CTA per tile of tokens (blockIdx.x) and KV head (blockIdx.y): a short block's few tiles
// still spread over the SMs. `padded` = gridDim.x * PREFILL_TILE tokens per head in kp and vp.
extern "C" __global__ void pack_keys(const float* __restrict__ k, const float* __restrict__ v,
                                     const u32* __restrict__ k_pos, u32 tokens, int kv_heads,
                                     u16* __restrict__ kp, u16* __restrict__ vp, u32* __restrict__ bounds) {
    const u32 tile = blockIdx.x, head = blockIdx.y, padded = gridDim.x * PREFILL_TILE;
    for (u32 i = threadIdx.x; i < PREFILL_TILE * (HEAD_DIM / 2); i += blockDim.x) {
        const u32 t = tile * PREFILL_TILE + i / (HEAD_DIM / 2), e = i % (HEAD_DIM / 2) * 2;
        float2 kx = make_float2(0.f, 0.f), vx = kx;
        if (t < tokens) {
            const u64 from = ((u64)t * kv_heads + head) * HEAD_DIM + e;
            kx = *reinterpret_cast<const float2*>(k + from);
            vx = *reinterpret_cast<const float2*>(v + from);
        }
        const u64 to = packed_at(head, padded, t, e);
        *reinterpret_cast<u32*>(kp + to) = pack2(kx.x, kx.y);
        *reinterpret_cast<u32*>(vp + to) = pack2(vx.x, vx.y);
    }
    tile_bounds(k_pos, tokens, bounds);
}

// pack_keys' layout (and grid) from keys already in a KV cache of the module's dtype: token t
// of the block is physical slot slots[t] of the pool (tokens x kv_heads x HEAD_DIM elements),
// copied 16 bytes at a time.
extern "C" __global__ void gather_keys(const u16* __restrict__ kc, const u16* __restrict__ vc,
                                       const u32* __restrict__ slots, const u32* __restrict__ k_pos,
                                       u32 tokens, int kv_heads, u16* __restrict__ kp, u16* __restrict__ vp,
                                       u32* __restrict__ bounds) {
    const u32 tile = blockIdx.x, head = blockIdx.y, padded = gridDim.x * PREFILL_TILE;
    for (u32 i = threadIdx.x; i < PREFILL_TILE * (HEAD_DIM / 8); i += blockDim.x) {
        const u32 t = tile * PREFILL_TILE + i / (HEAD_DIM / 8), e = i % (HEAD_DIM / 8) * 8;
        uint4 kx = make_uint4(0, 0, 0, 0), vx = kx;
        if (t < tokens) {
            const u64 from = ((u64)slots[t] * kv_heads + head) * HEAD_DIM + e;
            kx = *reinterpret_cast<const uint4*>(kc + from);
            vx = *reinterpret_cast<const uint4*>(vc + from);
        }
        const u64 to = packed_at(head, padded, t, e);
        *reinterpret_cast<uint4*>(kp + to) = kx;
        *reinterpret_cast<uint4*>(vp + to) = vx;
    }
    tile_bounds(k_pos, tokens, bounds);
}

// Q fragments of a warp's 16 rows from row0 of the CTA's `rows` (query q0 + r / gsz, head
// kvh gsz + r % gsz), scaled into the log2 domain; rows past `rows` are zero.
__device__ __forceinline__ void load_q_rows(u32 (&qa)[KCH][4], const float* q, u32 q0, int rows, int row0, int kvh,
                                            int gsz, int q_heads, float scale_log2) {
    const int lane = threadIdx.x % 32, g = lane / 4, tig = lane % 4;
    const float* at[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = row0 + g + 8 * h;
        at[h] = r < rows ? q + ((u64)(q0 + r / gsz) * q_heads + kvh * gsz + r % gsz) * HEAD_DIM : nullptr;
    }
#pragma unroll
    for (int c = 0; c < KCH; ++c)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float* p = at[i & 1];
            const int d = c * 16 + (i >> 1) * 8 + 2 * tig;
            const float2 x = p ? *reinterpret_cast<const float2*>(p + d) : make_float2(0.f, 0.f);
            qa[c][i] = pack2(x.x * scale_log2, x.y * scale_log2);
        }
}

// The positions and window starts (q_from null: 0) of a CTA's `nq` queries from q0, reduced
// over the warp: the first and last query positions and the smallest and largest window starts.
struct QueryBounds {
    u32 q_min, q_max, from_min, from_max;
};
__device__ __forceinline__ QueryBounds query_bounds(const u32* q_pos, const u32* q_from, u32 q0, u32 nq) {
    QueryBounds b{0xffffffffu, 0, 0xffffffffu, 0};
    for (u32 j = threadIdx.x % 32; j < nq; j += 32) {
        b.q_min = min(b.q_min, q_pos[q0 + j]);
        b.q_max = max(b.q_max, q_pos[q0 + j]);
        const u32 f = q_from ? q_from[q0 + j] : 0;
        b.from_min = min(b.from_min, f);
        b.from_max = max(b.from_max, f);
    }
    b.q_min = __reduce_min_sync(0xffffffffu, b.q_min);
    b.q_max = __reduce_max_sync(0xffffffffu, b.q_max);
    b.from_min = __reduce_min_sync(0xffffffffu, b.from_min);
    b.from_max = __reduce_max_sync(0xffffffffu, b.from_max);
    return b;
}

// This thread's two rows' positions and window starts, of a warp's 16 rows from row0 (rows
// past the CTA's are never written).
__device__ __forceinline__ void row_windows(u32 (&pos)[2], u32 (&from)[2], const u32* q_pos, const u32* q_from,
                                            u32 q0, int rows, int row0, int gsz) {
    const int g = threadIdx.x % 32 / 4;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = row0 + g + 8 * h;
        pos[h] = r < rows ? q_pos[q0 + r / gsz] : 0;
        from[h] = r < rows && q_from ? q_from[q0 + r / gsz] : 0;
    }
}

// The first tile from `t` that some query of the CTA may see, one with keys at positions in
// [from_min, q_max] (`tiles` if none).
__device__ __forceinline__ u32 next_seen(const u32* bounds, u32 t, u32 tiles, const QueryBounds& b) {
    while (t < tiles && (bounds[2 * t] > b.q_max || bounds[2 * t + 1] < b.from_min)) ++t;
    return t;
}

// Tile t's scores masked to each row's window, unless the tile is whole and every query of the
// CTA sees all of it.
__device__ __forceinline__ void mask_tile(float (&s)[NT][4], u32 t, u32 tokens, const u32* k_pos, const u32* bounds,
                                          const QueryBounds& b, const u32 (&pos)[2], const u32 (&from)[2]) {
    if ((t + 1) * PREFILL_TILE <= tokens && bounds[2 * t + 1] <= b.q_min && bounds[2 * t] >= b.from_max) return;
    const int tig = threadIdx.x % 4;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const u32 key = t * PREFILL_TILE + nt * 8 + 2 * tig + (i & 1);
            const u32 at = key < tokens ? k_pos[key] : 0;
            if (key >= tokens || at > pos[i >> 1] || at < from[i >> 1]) s[nt][i] = NEG_INF;
        }
}

// A warp's 16 rows from row0, normalised and rounded to the KV dtype into `out` (rows x
// q_heads x HEAD_DIM), the attention output itself, when the block is every key the rows see;
// a row that saw no key is zero, as the output of empty states.
__device__ __forceinline__ void store_rows(const float (&acc)[DTILES][4], const float (&l)[2], int row0, int rows,
                                           u32 q0, int gsz, int kvh, int q_heads, u16* __restrict__ out) {
    const int lane = threadIdx.x % 32, g = lane / 4, tig = lane % 4;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = row0 + g + 8 * h;
        if (r >= rows) continue;
        const u64 cell = (u64)(q0 + r / gsz) * q_heads + kvh * gsz + r % gsz;
        const float inv_l = l[h] == 0.f ? 0.f : 1.f / l[h];
        u32* to = reinterpret_cast<u32*>(out + cell * HEAD_DIM + 2 * tig);
#pragma unroll
        for (int d = 0; d < DTILES; ++d) to[d * 4] = pack2(acc[d][2 * h] * inv_l, acc[d][2 * h + 1] * inv_l);
    }
}

// A warp's 16 rows from row0: each row's block state (normalised o, natural-log lse) merges
// into its state as canopy_core::merge_state does; a row that saw no key leaves it as it is.
// With `out` (not null) the rows are stored there instead (store_rows).
__device__ __forceinline__ void merge_rows(float (&acc)[DTILES][4], const float (&m)[2], float (&l)[2], int row0,
                                           int rows, u32 q0, int gsz, int kvh, int q_heads, float* __restrict__ o,
                                           float* __restrict__ lse, u16* __restrict__ out) {
    const int lane = threadIdx.x % 32, g = lane / 4, tig = lane % 4;
    finish_l(l);
    if (out) {
        store_rows(acc, l, row0, rows, q0, gsz, kvh, q_heads, out);
        return;
    }
    float old_lse[2];
    u64 cell[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = row0 + g + 8 * h;
        cell[h] = r < rows ? (u64)(q0 + r / gsz) * q_heads + kvh * gsz + r % gsz : 0;
        old_lse[h] = r < rows ? lse[cell[h]] : NEG_INF;
    }
    __syncwarp();  // the quad has read each lse before its first lane writes it
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = row0 + g + 8 * h;
        if (r >= rows || l[h] == 0.f) continue;
        const float block_lse = (m[h] + __log2f(l[h])) * LN2, inv_l = 1.f / l[h];
        float wa = 0.f, wb = 1.f, inv = 1.f, merged = block_lse;
        if (old_lse[h] != NEG_INF) {
            const float top = fmaxf(old_lse[h], block_lse);
            wa = expf(old_lse[h] - top);
            wb = expf(block_lse - top);
            inv = 1.f / (wa + wb);
            merged = top + logf(wa + wb);
        }
        float* out = o + cell[h] * HEAD_DIM + 2 * tig;
#pragma unroll
        for (int d = 0; d < DTILES; ++d) {
            float2* p = reinterpret_cast<float2*>(out + d * 8);
            const float2 b = make_float2(acc[d][2 * h] * inv_l, acc[d][2 * h + 1] * inv_l);
            if (old_lse[h] == NEG_INF) {
                *p = b;
            } else {
                const float2 a = *p;
                *p = make_float2((a.x * wa + b.x * wb) * inv, (a.y * wa + b.y * wb) * inv);
            }
        }
        if (tig == 0) lse[cell[h]] = merged;
    }
}

#if HAS_WGMMA
// One step as the copying warpgroup publishes it beside its tiles: the two tiles (a step with
// one, the last, repeats it as its second, whose scores are all masked; `first` = the tile
// count ends the sequence) and which of them need masking.
struct Step {
    u32 first, second, flags;
};
#define STEP_PAIRED 1u
#define STEP_MASK_FIRST 2u
#define STEP_MASK_SECOND 4u

// The warp-specialised kernel's shared memory: its stages of one step's two K and two V tiles
// (swizzled, on 1024 bytes), and per stage barriers for the Ks and the Vs landing and for the
// consumers having read each: a stage's Ks are free once its Q K^T is done, well before its
// P V, so the next step's Ks load while the Vs are still read. The Ks are interleaved by half, [K0 dims 0-63][K1 dims 0-63]
// [K0 dims 64-127][K1 dims 64-127], so that one Q K^T MMA reads the step's 128 keys as rows;
// the Vs are whole tiles, one after the other.
static_assert(PREFILL_WS_TILES == 2, "a step is two tiles");
#define STEP_ELEMS (PREFILL_WS_TILES * PREFILL_TILE * HEAD_DIM)
struct WsShared {
    u16 k[PREFILL_WS_STAGES][STEP_ELEMS];
    u16 v[PREFILL_WS_STAGES][STEP_ELEMS];
    u16 q[PREFILL_CONSUMERS][64 * HEAD_DIM];  // each consumer's Q, laid out as a K tile
    u64 k_full[PREFILL_WS_STAGES], v_full[PREFILL_WS_STAGES], k_free[PREFILL_WS_STAGES], v_free[PREFILL_WS_STAGES];
    Step step[PREFILL_WS_STAGES];  // the step each stage holds, published with its Ks
};
#define SNT (PREFILL_WS_TILES * NT)  // n-tiles of scores per step
// Registers per thread of the copying warpgroup and of each consumer (65,536 in all).
#define PRODUCER_REGS 24
#define CONSUMER_REGS 240
static_assert(PRODUCER_REGS * 128 + CONSUMER_REGS * 128 * PREFILL_CONSUMERS <= 65536, "the SM's register file");

// Whether some query of the CTA sees only part of tile t (or the tile is not whole).
__device__ __forceinline__ bool tile_needs_mask(const u32* bounds, u32 t, u32 tokens, const QueryBounds& b) {
    return (t + 1) * PREFILL_TILE > tokens || bounds[2 * t + 1] > b.q_min || bounds[2 * t] < b.from_max;
}

// The step of the next two tiles some query of the CTA sees, from `t`.
__device__ __forceinline__ Step step_from(const u32* bounds, u32 t, u32 tiles, u32 tokens, const QueryBounds& b) {
    const u32 first = next_seen(bounds, t, tiles, b);
    if (first >= tiles) return {tiles, tiles, 0};
    const u32 second = next_seen(bounds, first + 1, tiles, b);
    if (second >= tiles) return {first, first, tile_needs_mask(bounds, first, tokens, b) ? STEP_MASK_FIRST : 0};
    return {first, second,
            STEP_PAIRED | (tile_needs_mask(bounds, first, tokens, b) ? STEP_MASK_FIRST : 0) |
                (tile_needs_mask(bounds, second, tokens, b) ? STEP_MASK_SECOND : 0)};
}

// The step's scores masked to each row's window (the second tile's wholly, if it repeats the
// first).
__device__ __forceinline__ void mask_step(float (&s)[SNT][4], const Step& st, u32 tokens, const u32* k_pos,
                                          const u32 (&pos)[2], const u32 (&from)[2]) {
    const int tig = threadIdx.x % 4;
#pragma unroll
    for (int h = 0; h < PREFILL_WS_TILES; ++h) {
        const u32 t = h == 0 ? st.first : st.second;
        const bool none = h == 1 && !(st.flags & STEP_PAIRED);
        if (!none && !(st.flags & (h == 0 ? STEP_MASK_FIRST : STEP_MASK_SECOND))) continue;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const u32 key = t * PREFILL_TILE + nt * 8 + 2 * tig + (i & 1);
                const u32 at = key < tokens ? k_pos[key] : 0;
                if (none || key >= tokens || at > pos[i >> 1] || at < from[i >> 1]) s[h * NT + nt][i] = NEG_INF;
            }
    }
}

// A consumer's 64 rows of Q (from the CTA's row0), scaled into the log2 domain and rounded,
// into shared memory as pack_keys lays out a tile (rows past `rows` are zero); its four warps
// then meet on named barrier 4 + c, and the MMAs may read it.
__device__ __forceinline__ void store_q(u16* qs, const float* q, u32 q0, int rows, int row0, int kvh, int gsz,
                                        int q_heads, float scale_log2, int c) {
    for (int i = threadIdx.x % 128; i < 64 * HEAD_DIM / 8; i += 128) {
        const int r = i / (HEAD_DIM / 8), e = i % (HEAD_DIM / 8) * 8, row = row0 + r;
        uint4 x = make_uint4(0, 0, 0, 0);
        if (row < rows) {
            const float* at = q + ((u64)(q0 + row / gsz) * q_heads + kvh * gsz + row % gsz) * HEAD_DIM + e;
            const float4 a = *reinterpret_cast<const float4*>(at), b = *reinterpret_cast<const float4*>(at + 4);
            x = make_uint4(pack2(a.x * scale_log2, a.y * scale_log2), pack2(a.z * scale_log2, a.w * scale_log2),
                           pack2(b.x * scale_log2, b.y * scale_log2), pack2(b.z * scale_log2, b.w * scale_log2));
        }
        *reinterpret_cast<uint4*>(qs + packed_at(0, 0, r, e)) = x;
    }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    asm volatile("bar.sync %0, 128;\n" ::"r"(4 + c) : "memory");
}

// Issues S (64 rows x the step's 128 keys) = Q K^T, uncommitted.
__device__ __forceinline__ void issue_scores(float (&s)[SNT][4], const u16* k, const u16* qs) {
#pragma unroll
    for (int nt = 0; nt < SNT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) s[nt][i] = 0.f;
    wg_fence();
#pragma unroll
    for (int c = 0; c < KCH; ++c)
        wg_qk128_ss(s, smem_desc(qs + (c / 4) * HALF + (c % 4) * 16, 16, 1024),
                    smem_desc(k + (c / 4) * PREFILL_WS_TILES * HALF + (c % 4) * 16, 16, 1024), c);
}

// Issues O += P V over the step's two V tiles, uncommitted (P: the step's k-chunks as A
// fragments).
__device__ __forceinline__ void issue_pv(float (&o)[DTILES][4], const u32 (&p)[SNT / 2][4], const u16* v) {
    wg_fence();
#pragma unroll
    for (int j = 0; j < SNT / 2; ++j)
        wg_pv(o, p[j], smem_desc(v + (j / 4) * 2 * HALF + (j % 4) * 16 * 64, 2 * HALF, 1024));
}

// A consumer warp is done reading a stage's Ks or Vs (its MMAs have completed).
__device__ __forceinline__ void release(u64* free) {
    __syncwarp();
    if (threadIdx.x % 32 == 0) mbar_arrive(free);
}

// The consumers take turns issuing their MMAs (FlashAttention-3's ping-pong): consumer c waits
// on named barrier 2 + c before it issues and lets the next one go after, so one's softmax
// runs while the other's MMAs do.
static_assert(PREFILL_CONSUMERS == 2, "two consumers take turns");
__device__ __forceinline__ void turn_wait(int c) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(2 + c), "n"(PREFILL_CONSUMERS * 128) : "memory");
}
__device__ __forceinline__ void turn_pass(int c) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(2 + (c + 1) % PREFILL_CONSUMERS), "n"(PREFILL_CONSUMERS * 128) : "memory");
}

extern "C" __global__ void __launch_bounds__((PREFILL_CONSUMERS + 1) * 128, 1)
prefill_attention(const float* __restrict__ q, const u32* __restrict__ q_pos, const u32* __restrict__ q_from,
                  u32 queries,
                  const u16* __restrict__ kp, const u16* __restrict__ vp, const u32* __restrict__ k_pos,
                  const u32* __restrict__ bounds, u32 tokens, float* __restrict__ o, float* __restrict__ lse,
                  u16* __restrict__ out, int q_heads, int kv_heads, u32 cta_queries, float scale_log2) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const u32 skew = (1024u - (smem_u32(smem_raw) & 1023u)) & 1023u;
    WsShared& sh = *reinterpret_cast<WsShared*>(smem_raw + skew);
    const int gsz = q_heads / kv_heads, kvh = blockIdx.y;
    const int wg = threadIdx.x / 128;
    const u32 q0 = (gridDim.x - 1 - blockIdx.x) * cta_queries;
    const u32 nq = min(cta_queries, queries - q0);
    const int rows = (int)nq * gsz;
    const u32 tiles = (tokens + PREFILL_TILE - 1) / PREFILL_TILE, padded = tiles * PREFILL_TILE;
    const QueryBounds b = query_bounds(q_pos, q_from, q0, nq);

    if (threadIdx.x == 0) {
        for (int s = 0; s < PREFILL_WS_STAGES; ++s) {
            mbar_init(&sh.k_full[s], 1);
            mbar_init(&sh.v_full[s], 1);
            mbar_init(&sh.k_free[s], PREFILL_CONSUMERS * 4);  // one arrival per consumer warp
            mbar_init(&sh.v_free[s], PREFILL_CONSUMERS * 4);
        }
        mbar_init_fence();
    }
    __syncthreads();  // the CTA's last: the copying warpgroup leaves early

    if (wg == 0) {
        regs_lower<PRODUCER_REGS>();
        if (threadIdx.x == 0) {
            // Every step, then one whose `first` is the tile count: the consumers' end.
            u32 it = 0, t = 0;
            for (;; ++it) {
                const Step step = step_from(bounds, t, tiles, tokens, b);
                const u32 st = it % PREFILL_WS_STAGES;
                const u32 reused = (it / PREFILL_WS_STAGES - 1) & 1;  // the stage's last phase
                if (it >= PREFILL_WS_STAGES) mbar_wait(&sh.k_free[st], reused);
                sh.step[st] = step;
                if (step.first >= tiles) {
                    mbar_arrive(&sh.k_full[st]);
                    break;
                }
                const u64 head = (u64)kvh * padded * HEAD_DIM;
                const u64 at[2] = {head + (u64)step.first * PREFILL_TILE * HEAD_DIM,
                                   head + (u64)step.second * PREFILL_TILE * HEAD_DIM};
                mbar_expect_bytes(&sh.k_full[st], PREFILL_WS_TILES * TILE_BYTES);
#pragma unroll
                for (int h = 0; h < PREFILL_WS_TILES; ++h)
#pragma unroll
                    for (int half = 0; half < 2; ++half)
                        bulk_copy(sh.k[st] + (half * PREFILL_WS_TILES + h) * HALF, kp + at[h] + half * HALF, TILE_BYTES / 2,
                                  &sh.k_full[st]);
                if (it >= PREFILL_WS_STAGES) mbar_wait(&sh.v_free[st], reused);
                mbar_expect_bytes(&sh.v_full[st], PREFILL_WS_TILES * TILE_BYTES);
#pragma unroll
                for (int h = 0; h < PREFILL_WS_TILES; ++h)
                    bulk_copy(sh.v[st] + h * 2 * HALF, vp + at[h], TILE_BYTES, &sh.v_full[st]);
                t = (step.flags & STEP_PAIRED ? step.second : step.first) + 1;
            }
        }
        return;
    }
    regs_raise<CONSUMER_REGS>();

    const int c = wg - 1, row0 = c * 64 + (threadIdx.x % 128) / 32 * 16;
    u32 pos[2], from[2];
    row_windows(pos, from, q_pos, q_from, q0, rows, row0, gsz);
    const u16* qs = sh.q[c];
    store_q(sh.q[c], q, q0, rows, c * 64, kvh, gsz, q_heads, scale_log2, c);
    float acc[DTILES][4], m[2], l[2];
    clear_state(acc, m, l);

    // Step `cur`'s scores (stage it) are in s: the first step's alone, then each later step's
    // issued before the P V of the step before it, so that its softmax runs while the tensor
    // cores work through both.
    mbar_wait(&sh.k_full[0], 0);
    Step cur = sh.step[0];
    u32 it = 0;
    float s[SNT][4];
    u32 p[SNT / 2][4];
    if (cur.first < tiles) {
        if (c == 1) turn_pass(c);  // consumer 0 goes first
        turn_wait(c);
        issue_scores(s, sh.k[0], qs);
        wg_commit();
        turn_pass(c);
        wg_wait<0>();
        wg_pin_all(s);
        release(&sh.k_free[0]);
        mask_step(s, cur, tokens, k_pos, pos, from);
        softmax_step(s, acc, m, l);
        for (;;) {
            const u32 st = it % PREFILL_WS_STAGES, nst = (it + 1) % PREFILL_WS_STAGES;
            mbar_wait(&sh.k_full[nst], (it + 1) / PREFILL_WS_STAGES & 1);
            const Step next = sh.step[nst];
            if (next.first >= tiles) break;
#pragma unroll
            for (int j = 0; j < SNT / 2; ++j) p_fragment(p[j], s, j);
            mbar_wait(&sh.v_full[st], it / PREFILL_WS_STAGES & 1);
            turn_wait(c);
            issue_scores(s, sh.k[nst], qs);
            wg_commit();
            issue_pv(acc, p, sh.v[st]);
            wg_commit();
            turn_pass(c);
            wg_wait<1>();
            wg_pin_all(s);
            release(&sh.k_free[nst]);
            mask_step(s, next, tokens, k_pos, pos, from);
            float alpha[2];
            softmax_scores(s, m, l, alpha);
            wg_wait<0>();
            wg_pin_all(acc);
            release(&sh.v_free[st]);
            rescale(acc, alpha);
            cur = next;
            ++it;
        }
        // The last step's P V (the copying warpgroup waits for no more stages).
        const u32 st = it % PREFILL_WS_STAGES;
#pragma unroll
        for (int j = 0; j < SNT / 2; ++j) p_fragment(p[j], s, j);
        mbar_wait(&sh.v_full[st], it / PREFILL_WS_STAGES & 1);
        turn_wait(c);
        issue_pv(acc, p, sh.v[st]);
        wg_commit();
        if (c == 0) turn_pass(c);  // consumer 1 has no turn left to take
        wg_wait<0>();
        wg_pin_all(acc);
    }
    merge_rows(acc, m, l, row0, rows, q0, gsz, kvh, q_heads, o, lse, out);
}

#else
// One stage of K and V tiles, rows padded for ldmatrix.
struct PrefillStage {
    u16 k[PREFILL_TILE][STRIDE];
    u16 v[PREFILL_TILE][STRIDE];
};

// Tile `t` of KV head `kvh` (kp and vp hold `padded` tokens per head) into a stage.
__device__ __forceinline__ void issue_tile(PrefillStage& st, const u16* kp, const u16* vp, u32 t, u32 padded,
                                           int kvh) {
    const u64 base = ((u64)kvh * padded + (u64)t * PREFILL_TILE) * HEAD_DIM;
    for (int i = threadIdx.x; i < PIECES; i += MMA_THREADS) {
        const int row = i / (HEAD_DIM / 8), piece = i % (HEAD_DIM / 8);
        cp_async16(&st.k[row][piece * 8], kp + base + (u64)i * 8, 16, false);
        cp_async16(&st.v[row][piece * 8], vp + base + (u64)i * 8, 16, false);
    }
}

extern "C" __global__ void __launch_bounds__(MMA_THREADS, 2)
prefill_attention(const float* __restrict__ q, const u32* __restrict__ q_pos, const u32* __restrict__ q_from,
                  u32 queries,
                  const u16* __restrict__ kp, const u16* __restrict__ vp, const u32* __restrict__ k_pos,
                  const u32* __restrict__ bounds, u32 tokens, float* __restrict__ o, float* __restrict__ lse,
                  u16* __restrict__ out, int q_heads, int kv_heads, u32 cta_queries, float scale_log2) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    PrefillStage* stages = reinterpret_cast<PrefillStage*>(smem_raw);
    const int gsz = q_heads / kv_heads, kvh = blockIdx.y;
    const int warp = threadIdx.x / 32;
    const u32 q0 = (gridDim.x - 1 - blockIdx.x) * cta_queries;
    const u32 nq = min(cta_queries, queries - q0);
    const int rows = (int)nq * gsz;
    const u32 tiles = (tokens + PREFILL_TILE - 1) / PREFILL_TILE, padded = tiles * PREFILL_TILE;
    const QueryBounds b = query_bounds(q_pos, q_from, q0, nq);
    u32 pos[2], from[2];
    row_windows(pos, from, q_pos, q_from, q0, rows, warp * 16, gsz);

    // Tiles in flight, oldest first (`tiles`: none).
    u32 flight[PREFILL_STAGES - 1];
    u32 ahead = next_seen(bounds, 0, tiles, b);
#pragma unroll
    for (int s = 0; s + 1 < PREFILL_STAGES; ++s) {
        flight[s] = ahead;
        if (ahead < tiles) {
            issue_tile(stages[s], kp, vp, ahead, padded, kvh);
            ahead = next_seen(bounds, ahead + 1, tiles, b);
        }
        cp_async_commit();
    }

    u32 qa[KCH][4];
    load_q_rows(qa, q, q0, rows, warp * 16, kvh, gsz, q_heads, scale_log2);
    float acc[DTILES][4], m[2], l[2];
    clear_state(acc, m, l);

    for (u32 it = 0; flight[0] < tiles; ++it) {
        const u32 t = flight[0];
        // The next tile goes into the stage computed on last (every warp left it at the barrier
        // that ended the last iteration).
#pragma unroll
        for (int s = 0; s + 2 < PREFILL_STAGES; ++s) flight[s] = flight[s + 1];
        flight[PREFILL_STAGES - 2] = ahead;
        if (ahead < tiles) {
            issue_tile(stages[(it + PREFILL_STAGES - 1) % PREFILL_STAGES], kp, vp, ahead, padded, kvh);
            ahead = next_seen(bounds, ahead + 1, tiles, b);
        }
        cp_async_commit();
        asm volatile("cp.async.wait_group %0;\n" ::"n"(PREFILL_STAGES - 1) : "memory");
        __syncthreads();
        // Warps past the rows rest.
        if (warp * 16 < rows) {
            const PrefillStage& st = stages[it % PREFILL_STAGES];
            float s[NT][4];
            qk_scores(s, st.k, qa);
            mask_tile(s, t, tokens, k_pos, bounds, b, pos, from);
            softmax_step(s, acc, m, l);
            pv_accumulate(acc, s, st.v);
        }
        __syncthreads();
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    merge_rows(acc, m, l, warp * 16, rows, q0, gsz, kvh, q_heads, o, lse, out);
}
#endif
