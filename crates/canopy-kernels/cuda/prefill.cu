// The prefill's causal attention on tensor cores, for KV in a 16-bit dtype: query rows at
// their positions over one block of keys at theirs, merged into the rows' states. The keys may
// be the rows' own (a prompt's chunk), a chunk from another rank or any earlier block: which key
// a query sees is decided by the positions alone (key position <= query position and, where
// the rows have windows, >= the row's q_from), never by where the block sits, so blocks merge
// exactly in any order.
//
// pack_keys: the block's keys and values (fp32 activations, tokens x kv_heads x HEAD_DIM) to
// the KV dtype, as the cache holds them, head-major and padded with zeros to whole tiles of
// PREFILL_TILE tokens; and each tile's smallest and largest position. gather_keys: the same
// layout from keys the cache holds, at any physical slots.
//
// prefill_attention: FlashAttention-2's scheme with the warp pieces of mma.cuh. One CTA per
// (block of queries, KV head), four warps of 16 rows; a CTA's rows are its queries x the KV
// head's GQA heads (row r: query r / gsz, head kvh gsz + r % gsz), so each tile of K and V in
// shared memory serves every head that reads it. Tiles of PREFILL_TILE keys stream through
// PREFILL_STAGES shared-memory stages with cp.async. A tile none of the CTA's queries sees is
// never loaded (with a prompt's positions in order, a block of queries reads the tiles up to
// its diagonal, and from its windows' first key); a tile every query sees whole is not masked;
// the others are masked score by score. Heavier CTAs (later queries) are launched first, so the last wave is of light ones.
//
// On Hopper, heads of 128 run on the warpgroup MMA (mma.cuh's wg_qk and wg_pv): the four warps
// are one warpgroup of 64 rows, and the tiles are laid out with the 128-byte swizzle the MMA
// reads them in. Elsewhere each warp multiplies its 16 rows with mma.sync and ldmatrix, from
// tiles whose rows are padded by MMA_ROW_PAD.

#ifndef PREFILL_TILE
#error "PREFILL_TILE must be defined by the kernel registry"
#endif
#ifndef PREFILL_STAGES
#error "PREFILL_STAGES must be defined by the kernel registry"
#endif
#ifndef MMA_THREADS
#error "MMA_THREADS must be defined by the kernel registry"
#endif
#define PIECES (PREFILL_TILE * HEAD_DIM / 8)  // 16-byte pieces of one tile of K (or V)
#define NT (PREFILL_TILE / 8)                 // n-tiles of scores per tile
#if HAS_WGMMA
static_assert(PREFILL_TILE == 64 && MMA_THREADS == 128, "wg_qk multiplies 64 rows by 64 keys");
#define HALF (PREFILL_TILE * 64)  // elements of one 64-wide half of a swizzled tile
#endif

// One stage of K and V tiles: padded rows for ldmatrix, or (warpgroup MMA) each tile two
// swizzled halves of HALF elements, K then V, the stage on 1024 bytes.
struct PrefillStage {
    u16 k[PREFILL_TILE][STRIDE];
    u16 v[PREFILL_TILE][STRIDE];
};
#if HAS_WGMMA
static_assert(4 * HALF * 2 <= sizeof(PrefillStage) && sizeof(PrefillStage) % 1024 == 0,
              "swizzled tiles fit a stage, and every stage starts on 1024 bytes");
#endif

// Tile blockIdx.x's smallest and largest key position into bounds (its first PREFILL_TILE
// threads read one key each).
__device__ __forceinline__ void tile_bounds(const u32* __restrict__ k_pos, u32 tokens, u32* __restrict__ bounds) {
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

// One CTA per tile of tokens; `padded` = gridDim.x * PREFILL_TILE tokens per head in kp and vp.
extern "C" __global__ void pack_keys(const float* __restrict__ k, const float* __restrict__ v,
                                     const u32* __restrict__ k_pos, u32 tokens, int kv_heads,
                                     u16* __restrict__ kp, u16* __restrict__ vp, u32* __restrict__ bounds) {
    const u32 tile = blockIdx.x, padded = gridDim.x * PREFILL_TILE;
    const u32 pairs_per_token = (u32)kv_heads * (HEAD_DIM / 2);
    for (u32 i = threadIdx.x; i < PREFILL_TILE * pairs_per_token; i += blockDim.x) {
        const u32 t = tile * PREFILL_TILE + i / pairs_per_token, rest = i % pairs_per_token;
        const u32 head = rest / (HEAD_DIM / 2), e = rest % (HEAD_DIM / 2) * 2;
        float2 kx = make_float2(0.f, 0.f), vx = kx;
        if (t < tokens) {
            const u64 from = ((u64)t * kv_heads + head) * HEAD_DIM + e;
            kx = *reinterpret_cast<const float2*>(k + from);
            vx = *reinterpret_cast<const float2*>(v + from);
        }
        const u64 to = ((u64)head * padded + t) * HEAD_DIM + e;
        *reinterpret_cast<u32*>(kp + to) = pack2(kx.x, kx.y);
        *reinterpret_cast<u32*>(vp + to) = pack2(vx.x, vx.y);
    }
    tile_bounds(k_pos, tokens, bounds);
}

// pack_keys' layout from keys already in a KV cache of the module's dtype: token t of the block
// is physical slot slots[t] of the pool (tokens x kv_heads x HEAD_DIM elements), copied 16 bytes
// at a time.
extern "C" __global__ void gather_keys(const u16* __restrict__ kc, const u16* __restrict__ vc,
                                       const u32* __restrict__ slots, const u32* __restrict__ k_pos,
                                       u32 tokens, int kv_heads, u16* __restrict__ kp, u16* __restrict__ vp,
                                       u32* __restrict__ bounds) {
    const u32 tile = blockIdx.x, padded = gridDim.x * PREFILL_TILE;
    const u32 pieces_per_token = (u32)kv_heads * (HEAD_DIM / 8);
    for (u32 i = threadIdx.x; i < PREFILL_TILE * pieces_per_token; i += blockDim.x) {
        const u32 t = tile * PREFILL_TILE + i / pieces_per_token, rest = i % pieces_per_token;
        const u32 head = rest / (HEAD_DIM / 8), e = rest % (HEAD_DIM / 8) * 8;
        uint4 kx = make_uint4(0, 0, 0, 0), vx = kx;
        if (t < tokens) {
            const u64 from = ((u64)slots[t] * kv_heads + head) * HEAD_DIM + e;
            kx = *reinterpret_cast<const uint4*>(kc + from);
            vx = *reinterpret_cast<const uint4*>(vc + from);
        }
        const u64 to = ((u64)head * padded + t) * HEAD_DIM + e;
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

// The first tile from `t` that some query of the CTA may see, one with keys at positions in
// [from_min, q_max] (`tiles` if none).
__device__ __forceinline__ u32 next_seen(const u32* bounds, u32 t, u32 tiles, u32 from_min, u32 q_max) {
    while (t < tiles && (bounds[2 * t] > q_max || bounds[2 * t + 1] < from_min)) ++t;
    return t;
}

// Tile `t` of KV head `kvh` (kp and vp hold `padded` tokens per head) into a stage.
__device__ __forceinline__ void issue_tile(PrefillStage& st, const u16* kp, const u16* vp, u32 t, u32 padded,
                                           int kvh) {
    const u64 base = ((u64)kvh * padded + (u64)t * PREFILL_TILE) * HEAD_DIM;
    for (int i = threadIdx.x; i < PIECES; i += MMA_THREADS) {
        const int row = i / (HEAD_DIM / 8), piece = i % (HEAD_DIM / 8);
#if HAS_WGMMA
        // Piece p of a row's half h at position p ^ (row % 8) of that row of half h.
        u16* k = &st.k[0][0];
        const int at = (piece / 8) * HALF + row * 64 + ((piece % 8) ^ (row % 8)) * 8;
        cp_async16(k + at, kp + base + (u64)i * 8, 16, false);
        cp_async16(k + 2 * HALF + at, vp + base + (u64)i * 8, 16, false);
#else
        cp_async16(&st.k[row][piece * 8], kp + base + (u64)i * 8, 16, false);
        cp_async16(&st.v[row][piece * 8], vp + base + (u64)i * 8, 16, false);
#endif
    }
}

// One tile's scores for a warp's 16 rows of the 64 (S = Q K^T).
__device__ __forceinline__ void tile_scores(float (&s)[NT][4], const PrefillStage& st, const u32 (&qa)[KCH][4]) {
#if HAS_WGMMA
    const u16* k = &st.k[0][0];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) s[nt][i] = 0.f;
    wg_fence();
#pragma unroll
    for (int c = 0; c < KCH; ++c) wg_qk(s, qa[c], smem_desc(k + (c / 4) * HALF + (c % 4) * 16, 16, 1024), c);
    wg_commit_and_wait();
    wg_pin_all(s);
#else
    qk_scores(s, st.k, qa);
#endif
}

// O += P V for one tile (P: the scores after softmax_step).
__device__ __forceinline__ void tile_pv(float (&o)[DTILES][4], const float (&s)[NT][4], const PrefillStage& st) {
#if HAS_WGMMA
    const u16* v = &st.k[0][0] + 2 * HALF;
    wg_pin_all(o);
    // P's fragments before the fence: registers written between two of a batch's MMAs make
    // the compiler insert waits.
    u32 a[NT / 2][4];
#pragma unroll
    for (int j = 0; j < NT / 2; ++j) p_fragment(a[j], s, j);
    wg_fence();
#pragma unroll
    for (int j = 0; j < NT / 2; ++j) wg_pv(o, a[j], smem_desc(v + j * 16 * 64, 2 * HALF, 1024));
    wg_commit_and_wait();
    wg_pin_all(o);
#else
    pv_accumulate(o, s, st.v);
#endif
}

extern "C" __global__ void __launch_bounds__(MMA_THREADS, 2)
prefill_attention(const float* __restrict__ q, const u32* __restrict__ q_pos, const u32* __restrict__ q_from,
                  u32 queries,
                  const u16* __restrict__ kp, const u16* __restrict__ vp, const u32* __restrict__ k_pos,
                  const u32* __restrict__ bounds, u32 tokens, float* __restrict__ o, float* __restrict__ lse,
                  int q_heads, int kv_heads, u32 cta_queries, float scale_log2) {
    // The stages from the first 1024-byte boundary (the host gives 1 KB more for it).
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const u32 skew = (1024u - ((u32)__cvta_generic_to_shared(smem_raw) & 1023u)) & 1023u;
    PrefillStage* stages = reinterpret_cast<PrefillStage*>(smem_raw + skew);
    const int gsz = q_heads / kv_heads, kvh = blockIdx.y;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tig = lane % 4;
    const u32 q0 = (gridDim.x - 1 - blockIdx.x) * cta_queries;
    const u32 nq = min(cta_queries, queries - q0);
    const int rows = (int)nq * gsz;
    const u32 tiles = (tokens + PREFILL_TILE - 1) / PREFILL_TILE, padded = tiles * PREFILL_TILE;

    // The CTA's first and last query positions and window starts (q_from null: 0), in every
    // warp (at most 64 queries a CTA).
    u32 q_min = 0xffffffffu, q_max = 0, from_min = 0xffffffffu, from_max = 0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const u32 j = lane + 32 * h;
        if (j < nq) {
            q_min = min(q_min, q_pos[q0 + j]);
            q_max = max(q_max, q_pos[q0 + j]);
            const u32 f = q_from ? q_from[q0 + j] : 0;
            from_min = min(from_min, f);
            from_max = max(from_max, f);
        }
    }
    q_min = __reduce_min_sync(0xffffffffu, q_min);
    q_max = __reduce_max_sync(0xffffffffu, q_max);
    from_min = __reduce_min_sync(0xffffffffu, from_min);
    from_max = __reduce_max_sync(0xffffffffu, from_max);
    // This thread's two rows' positions and window starts (rows past the CTA's are never
    // written).
    u32 pos[2], from[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = warp * 16 + g + 8 * h;
        pos[h] = r < rows ? q_pos[q0 + r / gsz] : 0;
        from[h] = r < rows && q_from ? q_from[q0 + r / gsz] : 0;
    }

    // Tiles in flight, oldest first (`tiles`: none).
    u32 flight[PREFILL_STAGES - 1];
    u32 ahead = next_seen(bounds, 0, tiles, from_min, q_max);
#pragma unroll
    for (int s = 0; s + 1 < PREFILL_STAGES; ++s) {
        flight[s] = ahead;
        if (ahead < tiles) {
            issue_tile(stages[s], kp, vp, ahead, padded, kvh);
            ahead = next_seen(bounds, ahead + 1, tiles, from_min, q_max);
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
            ahead = next_seen(bounds, ahead + 1, tiles, from_min, q_max);
        }
        cp_async_commit();
        asm volatile("cp.async.wait_group %0;\n" ::"n"(PREFILL_STAGES - 1) : "memory");
#if HAS_WGMMA
        // The MMA reads shared memory through the async proxy: this thread's copies must be
        // visible to it before the barrier.
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
        __syncthreads();
        // (A warpgroup multiplies all 64 rows together; mma.sync warps past the rows rest.)
        if (HAS_WGMMA || warp * 16 < rows) {
            const PrefillStage& st = stages[it % PREFILL_STAGES];
            float s[NT][4];
            tile_scores(s, st, qa);
            // Masked unless the tile is whole and every query sees all of it.
            if ((t + 1) * PREFILL_TILE > tokens || bounds[2 * t + 1] > q_min || bounds[2 * t] < from_max) {
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const u32 key = t * PREFILL_TILE + nt * 8 + 2 * tig + (i & 1);
                        const u32 at = key < tokens ? k_pos[key] : 0;
                        if (key >= tokens || at > pos[i >> 1] || at < from[i >> 1]) s[nt][i] = NEG_INF;
                    }
            }
            softmax_step(s, acc, m, l);
            tile_pv(acc, s, st);
        }
        __syncthreads();
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");

    // Each row's block state (normalised o, natural-log lse) merges into its state as
    // canopy_core::merge_state does; a row that saw no key leaves it as it is.
    finish_l(l);
    float old_lse[2];
    u64 cell[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = warp * 16 + g + 8 * h;
        cell[h] = r < rows ? (u64)(q0 + r / gsz) * q_heads + kvh * gsz + r % gsz : 0;
        old_lse[h] = r < rows ? lse[cell[h]] : NEG_INF;
    }
    __syncwarp();  // the quad has read each lse before its first lane writes it
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = warp * 16 + g + 8 * h;
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
