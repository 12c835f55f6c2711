// Stage 1 of decoding on tensor cores: the same plans as decode.cu, for groups whose queries
// share KV (shared prefixes: FastTree's and DeFT's groups, GQA). One kernel, decode_partial_mma
// (at the end of the file), runs a list of CTA descriptors, each CTA one of two kinds: many rows
// of one KV head (groups of more than 16 rows) or one warp per KV head (`attend_heads`, groups
// of up to 16 rows). On Hopper (sm_90a) the many-row CTAs run on the warpgroup MMA
// (`attend_rows_wg`, wgmma with K and V read from swizzled shared memory); elsewhere, and where
// the warpgroup path does not apply, on mma.sync (`attend_rows`).
//
// `attend_rows` (mma.sync): one CTA per (plan group, KV head), four warps. A group's rows are its queries
// x the GQA rows of the KV head, at most 64 (the host splits larger groups by query, so each
// CTA holds all its rows in registers). KV streams through shared memory in tiles of TILE tokens, STAGES stages
// deep with cp.async (the next STAGES - 1 tiles are in flight while the warps compute on one).
//
// (A persistent variant, one CTA per bin of consecutive groups with the tile stream running
// across group boundaries, measured slower on every FastTree tree on H100: docs/BENCHMARKS.md.)
//
// Warps share the work of a tile two ways, chosen per CTA at run time from the group's rows:
// WR row blocks of 16 rows (one m16 tile each) x WK token slices of the tile (WR * WK = 4). A
// group of 16 rows or fewer runs WK = 4 (every warp applies its own quarter of the tokens to the
// same 16-row tile; the host sends such groups to `attend_heads` when it can); a 64-row group
// runs WR = 4: every warp sees every token for its own 16 rows. Each warp keeps an
// online-softmax state for its rows; slices are merged at the end.
//
// At the end the warps' states are merged through shared memory (reusing the tile stages) and
// written as normalised partials (o, natural-log lse).
//
// Per warp and tile: S = Q K^T by mma.sync.m16n8k16 (Q fragments stay in registers for the
// whole group; K fragments come from shared memory by ldmatrix), masking and the online softmax
// on the accumulators (log2 domain: Q is pre-scaled by scale * log2(e)), then O += P V with P
// converted in registers from the S accumulators to A fragments and V by ldmatrix.trans.
// Shared-memory rows are padded by 16 bytes so ldmatrix's eight row addresses hit distinct banks.
//
// Compile-time parameters: CANOPY_DTYPE (1 = f16, 2 = bf16), HEAD_DIM (64 or 128), TILE and
// STAGES (the many-row path's pipeline). The warp-level pieces are in mma.cuh.

#ifndef MMA_THREADS
#error "MMA_THREADS must be defined by the kernel registry"
#endif
#define THREADS MMA_THREADS
#define WARPS (THREADS / 32)
// KV tokens per shared-memory tile: 32 or 64.
#ifndef TILE
#error "TILE must be defined by the kernel registry"
#endif
// Shared-memory stages: STAGES - 1 tiles are in flight while one is computed.
#ifndef STAGES
#error "STAGES must be defined by the kernel registry"
#endif
#define WK_MAX (TILE / 16)  // token slices per tile (P V needs 16 tokens per slice)
// Resident CTAs per SM the registers are budgeted for, as many as the stages' shared memory
// lets fit (the host computes the true occupancy).
#if TILE == 32 && STAGES == 2
#define MIN_CTAS 4
#elif STAGES * TILE <= 128
#define MIN_CTAS 3
#elif STAGES * TILE <= 192
#define MIN_CTAS 2
#else
#define MIN_CTAS 1
#endif
// At most CTA_ROWS rows per CTA (the host splits larger groups by query).
#ifndef CTA_ROWS
#error "CTA_ROWS must be defined by the kernel registry"
#endif
#define CHUNKS (HEAD_DIM / 8)  // 16-byte pieces per token row
// u32 words of a CTA's descriptor (see read_cta).
#ifndef CTA_WORDS
#error "CTA_WORDS must be defined by the kernel registry"
#endif

// One pipeline stage: a tile of K and V, contiguous so the epilogue can reuse it whole.
struct Stage {
    u16 k[TILE][STRIDE];
    u16 v[TILE][STRIDE];
};

struct Scratch {
    float m[WARPS][16];
    float l[WARPS][16];
    float weight[WARPS][CTA_ROWS];  // per (slice, row): exp2(m - M) / L
    __align__(16) float o[WARPS][16][HEAD_DIM];
};

static_assert(sizeof(Scratch) <= STAGES * sizeof(Stage), "the scratch fits the stages");

// A CTA's descriptor (see the host's upload_plan): its group's fields, its first KV head (bit
// 16: the one-warp-per-head path) and the group's first KV range, so that a CTA's first KV
// address needs no load beyond its own descriptor (three 16-byte loads from one line).
struct GroupDesc {
    u32 range_begin, query_begin, query_count, partial_base, mask_plus1, tokens, flags, head, first_start, first_end;
};

__device__ __forceinline__ GroupDesc read_cta(const u32* ctas, u32 i) {
    const uint4* d = reinterpret_cast<const uint4*>(ctas + (u64)i * CTA_WORDS);
    const uint4 a = d[0], b = d[1], c = d[2];
    return GroupDesc{a.x, a.z, a.w, b.x, b.y, b.z, b.w, c.x, c.y, c.z};
}

// Streams a group's KV tokens into shared-memory tiles with cp.async, DEPTH stages deep: while
// the warps compute on one tile, the next DEPTH - 1 are in flight. A token's row is PIECES
// 16-byte pieces (CHUNKS per KV head, consecutive heads); thread t copies piece t % PIECES of
// tile rows t / PIECES + i * (THREADS / PIECES), into element ((c / CHUNKS) * TOKENS + r) *
// STRIDE + (c % CHUNKS) * 8 of a stage (one [TOKENS][STRIDE] block per head).
//
// A tile whose tokens are contiguous in memory (inside one KV range and, when paged, one page:
// every tile of a node-sized group on contiguous KV) costs one address computation per thread;
// only tiles that cross a range or page boundary map every row on its own. The range cursor
// only moves forward, as the tiles do.
//
// SWIZZLED (one head of 128 elements) lays a tile out as the warpgroup MMA reads it with the
// 128-byte swizzle: two blocks of 64 elements (one per half of HEAD_DIM), each TOKENS rows of
// 128 bytes, the 16-byte piece p of token t at position p ^ (t % 8) of its row. Eight
// consecutive threads copy one row of a block: one 128-byte line of global memory, written to
// eight different bank groups.
template <int PIECES, int TOKENS, int DEPTH, bool SWIZZLED = false>
struct KvStream {
    static_assert(!SWIZZLED || (PIECES == CHUNKS && CHUNKS == 16), "swizzled tiles hold one head of 128");
    static constexpr int ROWS_PER_PASS = THREADS / PIECES;
    // Elements from one pass's rows to the next pass's in a block.
    static constexpr int PASS_STEP = SWIZZLED ? ROWS_PER_PASS * 64 : ROWS_PER_PASS * STRIDE;
    const unsigned char* k;  // this thread's piece of token 0
    const unsigned char* v;
    const u32* ranges;
    const u32* page_table;  // null: contiguous KV
    u32 page_shift;
    u64 stride;  // bytes from one token to the next
    bool evict_first;  // the group streams its KV (GROUP_KV_STREAMED)
    u32 range_begin, tokens;
    u32 ri, seg_local, seg_end, seg_addr;  // cursor: the range holding local tokens [seg_local, seg_end)
    int dst, row_first;                    // this thread's element offset in a block, first row

    __device__ __forceinline__ void start(const unsigned char* kc, const unsigned char* vc, const u32* rs,
                                          const u32* pt, u32 shift, int kv_heads, int kvh0, const GroupDesc& cd) {
        const int piece = threadIdx.x % PIECES;
        stride = (u64)kv_heads * HEAD_DIM * 2;
        evict_first = cd.flags & GROUP_KV_STREAMED;
        row_first = threadIdx.x / PIECES;
        dst = SWIZZLED ? (piece / 8) * (TOKENS * 64) + row_first * 64 + ((piece % 8) ^ (row_first % 8)) * 8
                       : ((piece / CHUNKS) * TOKENS + row_first) * STRIDE + (piece % CHUNKS) * 8;
        const u64 head = ((u64)kvh0 * HEAD_DIM + piece * 8) * 2;
        k = kc + head;
        v = vc + head;
        ranges = rs;
        page_table = pt;
        page_shift = shift;
        range_begin = cd.range_begin;
        tokens = cd.tokens;
        ri = 0;
        seg_local = 0;
        seg_addr = cd.first_start;
        seg_end = cd.first_end - cd.first_start;
    }

    // Logical KV index of group-local token `local` (not before the cursor).
    __device__ __forceinline__ u32 seek(u32 local) {
        while (local >= seg_end) {
            ++ri;
            const u32 b = ranges[2 * (range_begin + ri)], e = ranges[2 * (range_begin + ri) + 1];
            seg_local = seg_end;
            seg_end += e - b;
            seg_addr = b;
        }
        return seg_addr + (local - seg_local);
    }

    __device__ __forceinline__ u64 physical(u32 t) const {
        return page_table ? (u64)((page_table[t >> page_shift] << page_shift) | (t & ((1u << page_shift) - 1u))) : t;
    }

    // Tile `tile` into the stage whose K and V blocks start at ks and vs.
    __device__ __forceinline__ void issue(u16* ks, u16* vs, u32 tile) {
        const u32 lo = tile * TOKENS;
        const u32 n = min((u32)TOKENS, tokens - lo);
        const u32 t_lo = seek(lo);
        const bool contiguous = lo + n <= seg_end && (!page_table || (t_lo >> page_shift) == ((t_lo + n - 1) >> page_shift));
        if (contiguous) {
            const u64 base = (physical(t_lo) + row_first) * stride;
#pragma unroll
            for (int i = 0; i < TOKENS / ROWS_PER_PASS; ++i) {
                const int r = row_first + i * ROWS_PER_PASS;
                const bool valid = (u32)r < n;
                const u64 off = valid ? base + (u64)(i * ROWS_PER_PASS) * stride : 0;
                cp_async16(ks + dst + i * PASS_STEP, k + off, valid ? 16 : 0, evict_first);
                cp_async16(vs + dst + i * PASS_STEP, v + off, valid ? 16 : 0, evict_first);
            }
        } else {
#pragma unroll 1
            for (int i = 0; i < TOKENS / ROWS_PER_PASS; ++i) {
                const int r = row_first + i * ROWS_PER_PASS;
                const bool valid = (u32)r < n;
                const u64 off = valid ? physical(seek(lo + r)) * stride : 0;
                cp_async16(ks + dst + i * PASS_STEP, k + off, valid ? 16 : 0, evict_first);
                cp_async16(vs + dst + i * PASS_STEP, v + off, valid ? 16 : 0, evict_first);
            }
        }
        cp_async_commit();
    }

    // Tile `tile` into the stage at ks and vs if the group has it, else an empty commit group,
    // so that every step waits for the same number of groups.
    __device__ __forceinline__ void issue_or_skip(u16* ks, u16* vs, u32 tile, u32 tiles) {
        if (tile < tiles) issue(ks, vs, tile);
        else cp_async_commit();
    }

    // The top of tile `tile`'s step: tile + DEPTH - 1 goes in flight into the stage at ks and
    // vs (the one tile - 1 used), then the CTA waits until tile `tile` has landed.
    __device__ __forceinline__ void next(u16* ks, u16* vs, u32 tile, u32 tiles) {
        issue_or_skip(ks, vs, tile + DEPTH - 1, tiles);
        asm volatile("cp.async.wait_group %0;\n" ::"n"(DEPTH - 1) : "memory");
        __syncthreads();
    }
};

// Q fragments of one warp's 16 rows (rows g and g + 8 of the block starting at row0, all of
// HEAD_DIM) as 16-bit pairs, scaled into the log2 domain. Rows past the group's are zero:
// finite scores, never written.
__device__ __forceinline__ void load_q(u32 (&qa)[KCH][4], const float* q, const u32* group_queries,
                                       const GroupDesc& cd, int rows, int row0, int kvh, int gsz, int q_heads,
                                       float scale_log2) {
    const int lane = threadIdx.x % 32, g = lane / 4, tig = lane % 4;
    const int r0 = row0 + g, r1 = r0 + 8;
    const float* qrow0 = r0 < rows
        ? q + ((u64)group_queries[cd.query_begin + r0 / gsz] * q_heads + kvh * gsz + r0 % gsz) * HEAD_DIM
        : nullptr;
    const float* qrow1 = r1 < rows
        ? q + ((u64)group_queries[cd.query_begin + r1 / gsz] * q_heads + kvh * gsz + r1 % gsz) * HEAD_DIM
        : nullptr;
#pragma unroll
    for (int c = 0; c < KCH; ++c)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float* p = (i & 1) ? qrow1 : qrow0;
            const int d = c * 16 + (i >> 1) * 8 + 2 * tig;
            const float2 x = p ? *reinterpret_cast<const float2*>(p + d) : make_float2(0.f, 0.f);
            qa[c][i] = pack2(x.x * scale_log2, x.y * scale_log2);
        }
}

// The mask bits of a thread's two rows (g and g + 8 of the 16 from row0) over NT n-tiles of
// scores from group-local token `first`, which lie in one 64-token block of the mask
// (`mask_word`), and for NT <= 4 in one aligned half of it: so two loads a tile, of 32 bits
// where 32 tokens are all the tile has. All ones when the group is unmasked. (Tested token by
// token, the mask's loads ran one after another, and masked tiles took several times as long
// as plain ones: BENCHMARKS, session 10.)
template <bool Wide> struct MaskBits { using type = u64; };
template <> struct MaskBits<false> { using type = u32; };

template <int NT>
__device__ __forceinline__ void row_mask_bits(typename MaskBits<(NT > 4)>::type (&w)[2], const u64* mask, u32 first,
                                              u32 queries, int row0, int gsz) {
    const int g = (threadIdx.x % 32) / 4;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        // (Rows past the group's read its last query's word: they are never written.)
        const u32 j = min((u32)(row0 + g + 8 * h) / gsz, queries - 1);
        if constexpr (NT > 4)
            w[h] = mask ? *mask_word(mask, first, queries, j) : ~0ull;
        else
            w[h] = mask ? reinterpret_cast<const u32*>(mask_word(mask, first, queries, j))[first % 64 / 32] : ~0u;
    }
}

// Scores past the group's tokens, or hidden from a row's query by its mask bits `w`
// (`row_mask_bits`), to -inf. `first` is the group-local index of the scores' first token
// (column 0 of n-tile 0).
template <int NT>
__device__ __forceinline__ void mask_scores(float (&s)[NT][4], u32 first, u32 tokens,
                                            const typename MaskBits<(NT > 4)>::type (&w)[2]) {
    constexpr u32 BITS = NT > 4 ? 64 : 32;
    const int tig = threadIdx.x % 4;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const u32 local = first + nt * 8 + 2 * tig + (i & 1);
            if (local >= tokens || !((w[i >> 1] >> (local % BITS)) & 1u)) s[nt][i] = NEG_INF;
        }
}

// One warp's slice of one tile: SLICE tokens (rows of k and v) for its 16 rows. S = Q K^T, the
// online softmax (S is already in the log2 domain), O += P V. `first` is the group-local index
// of the slice's first token; `edge`: the tile runs past the group's tokens or the group is
// masked, so scores are tested one by one (interior tiles of unmasked groups skip the tests).
template <int SLICE>
__device__ __forceinline__ void attend(const u16 (*k)[STRIDE], const u16 (*v)[STRIDE], const u32 (&qa)[KCH][4],
                                       float (&o)[DTILES][4], float (&m)[2], float (&l)[2], u32 first, bool edge,
                                       u32 tokens, const u64* mask, u32 queries, int row0, int gsz) {
    constexpr int NT = SLICE / 8;  // n-tiles of 8 tokens
    float s[NT][4];
    qk_scores(s, k, qa);
    if (edge) {
        typename MaskBits<(NT > 4)>::type w[2];
        row_mask_bits<NT>(w, mask, first, queries, row0, gsz);
        mask_scores(s, first, tokens, w);
    }
    softmax_step(s, o, m, l);
    pv_accumulate(o, s, v);
}

// A warp that holds whole rows normalises and writes them straight from its accumulators.
__device__ __forceinline__ void write_rows(const float (&o)[DTILES][4], const float (&m)[2], const float (&l)[2],
                                           float* out_o, float* out_lse, u32 partial_base, int rows, int row0,
                                           int kvh, int gsz, int q_heads) {
    const int lane = threadIdx.x % 32, g = lane / 4, tig = lane % 4;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = row0 + g + 8 * h;
        if (row < rows) {
            const u64 prow = (u64)partial_base + row / gsz;
            const int head = kvh * gsz + row % gsz;
            const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
            float* dst = out_o + (prow * q_heads + head) * HEAD_DIM + 2 * tig;
            const u64 keep = l2_policy(true);
#pragma unroll
            for (int d = 0; d < DTILES; ++d)
                store_kept(reinterpret_cast<float2*>(dst + d * 8), make_float2(o[d][2 * h] * inv, o[d][2 * h + 1] * inv),
                           keep);
            if (tig == 0)
                store_kept(out_lse + prow * q_heads + head, l[h] > 0.f ? (m[h] + __log2f(l[h])) * LN2 : NEG_INF, keep);
        }
    }
}

// A CTA of many rows: one (group, KV head), four warps; see the top of the file.
__device__ __forceinline__ void attend_rows(STAGE1_PARAMS, const GroupDesc& cd, int kvh, unsigned char* smem_raw) {
    Stage* stage_mem = reinterpret_cast<Stage*>(smem_raw);  // STAGES stages
    const int gsz = q_heads / kv_heads;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, tig = lane % 4;

    KvStream<CHUNKS, TILE, STAGES> kv;
    kv.start(kc, vc, ranges, page_table, page_shift, kv_heads, kvh, cd);
    const u32 tiles = (cd.tokens + TILE - 1) / TILE;
#pragma unroll
    for (int s = 0; s + 1 < STAGES; ++s) kv.issue_or_skip(&stage_mem[s].k[0][0], &stage_mem[s].v[0][0], s, tiles);

    const int rows = min((int)cd.query_count * gsz, CTA_ROWS);
    const int wr = max(rows <= 16 ? 1 : (rows <= 32 ? 2 : 4), WARPS / WK_MAX);
    const int wk = WARPS / wr;
    const int rb = warp % wr, ks = warp / wr;
    const int t0 = ks * (TILE / wk);  // first token of this warp's slice within a tile
    const u64* mask = cd.mask_plus1 ? masks + cd.mask_plus1 - 1 : nullptr;

    u32 qa[KCH][4];
    load_q(qa, q, group_queries, cd, rows, rb * 16, kvh, gsz, q_heads, scale_log2);
    float o[DTILES][4], m[2], l[2];
    clear_state(o, m, l);

    for (u32 tile = 0; tile < tiles; ++tile) {
        Stage& next = stage_mem[(tile + STAGES - 1) % STAGES];
        kv.next(&next.k[0][0], &next.v[0][0], tile, tiles);
        const u32 first = tile * TILE + t0;
        // A warp whose slice lies wholly past the group's tokens has nothing to add.
        if (first < cd.tokens) {
            const bool edge = mask || tile * TILE + TILE > cd.tokens;
            const Stage& st = stage_mem[tile % STAGES];
            if (wk == 1) attend<TILE>(&st.k[t0], &st.v[t0], qa, o, m, l, first, edge, cd.tokens, mask, cd.query_count, rb * 16, gsz);
#if WK_MAX >= 2
            else if (wk == 2) attend<TILE / 2>(&st.k[t0], &st.v[t0], qa, o, m, l, first, edge, cd.tokens, mask, cd.query_count, rb * 16, gsz);
#endif
#if WK_MAX >= 4
            else attend<TILE / 4>(&st.k[t0], &st.v[t0], qa, o, m, l, first, edge, cd.tokens, mask, cd.query_count, rb * 16, gsz);
#endif
        }
        __syncthreads();  // every warp is done with this stage before it is refilled
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    __syncthreads();

    finish_l(l);
    if (wk == 1) {
        write_rows(o, m, l, out_o, out_lse, cd.partial_base, rows, rb * 16, kvh, gsz, q_heads);
        return;
    }
    // Several warps share each row: states through shared memory (reusing the tile stages),
    // one weight per (slice, row), then a vectorised weighted sum per element.
    Scratch& sc = *reinterpret_cast<Scratch*>(stage_mem);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        if (tig == 0) {
            sc.m[warp][g + 8 * h] = m[h];
            sc.l[warp][g + 8 * h] = l[h];
        }
    }
#pragma unroll
    for (int d = 0; d < DTILES; ++d) {
        *reinterpret_cast<float2*>(&sc.o[warp][g][d * 8 + 2 * tig]) = make_float2(o[d][0], o[d][1]);
        *reinterpret_cast<float2*>(&sc.o[warp][g + 8][d * 8 + 2 * tig]) = make_float2(o[d][2], o[d][3]);
    }
    __syncthreads();
    if (threadIdx.x < rows) {
        const int row = threadIdx.x, b = row / 16, r = row % 16;
        float M = NEG_INF;
        for (int k = 0; k < wk; ++k) M = fmaxf(M, sc.m[b + k * wr][r]);
        float L = 0.f;
        if (M != NEG_INF)
            for (int k = 0; k < wk; ++k) L = fmaf(sc.l[b + k * wr][r], fast_exp2(sc.m[b + k * wr][r] - M), L);
        const float inv = L > 0.f ? 1.f / L : 0.f;
        for (int k = 0; k < wk; ++k)
            sc.weight[k][row] = L > 0.f ? fast_exp2(sc.m[b + k * wr][r] - M) * inv : 0.f;
        const u64 prow = (u64)cd.partial_base + row / gsz;
        store_kept(out_lse + prow * q_heads + kvh * gsz + row % gsz, L > 0.f ? (M + __log2f(L)) * LN2 : NEG_INF,
                   l2_policy(true));
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < rows * (HEAD_DIM / 4); idx += THREADS) {
        const int row = idx / (HEAD_DIM / 4), d = (idx % (HEAD_DIM / 4)) * 4;
        const int b = row / 16, r = row % 16;
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int k = 0; k < wk; ++k) {
            const float w = sc.weight[k][row];
            const float4 x = *reinterpret_cast<const float4*>(&sc.o[b + k * wr][r][d]);
            acc.x = fmaf(x.x, w, acc.x);
            acc.y = fmaf(x.y, w, acc.y);
            acc.z = fmaf(x.z, w, acc.z);
            acc.w = fmaf(x.w, w, acc.w);
        }
        const u64 prow = (u64)cd.partial_base + row / gsz;
        const int head = kvh * gsz + row % gsz;
        store_kept(reinterpret_cast<float4*>(out_o + (prow * q_heads + head) * HEAD_DIM + d), acc, l2_policy(true));
    }
}

// The warpgroup path is built where its accumulators fit the registers: not in modules of four
// CTAs per SM (32-token tiles in two stages), nor beside the mma.sync path's 64-token tiles,
// which already spill.
#if HAS_WGMMA && TILE == 32 && MIN_CTAS <= 3
#define WGMMA 1
#else
#define WGMMA 0
#endif

#if WGMMA
// Groups of more rows than the one-warp-per-head path takes run on the warpgroup MMA, even
// those of 17-32 rows that leave half of its 64 rows empty: faster than mma.sync's split of
// the tokens on every FastTree tree (docs/BENCHMARKS.md, session 9).
#ifndef HEADS_ROWS
#error "HEADS_ROWS must be defined by the kernel registry"
#endif
#define WG_MIN_ROWS (HEADS_ROWS + 1)

// A CTA of 17 to 64 rows of one KV head on the warpgroup MMA: each warp holds 16 rows and the
// four multiply every tile together. Tiles are 64 tokens, two stages of 32 KB (K and V, each
// swizzled) in the CTA's shared memory: one tile in flight while the other is multiplied. Per
// tile: S = Q K^T in 8 MMAs of k16 (n64), the same masking and online softmax as `attend` on
// the accumulators, then O += P V in four MMAs of 16 tokens. (32-token tiles, four stages, took
// 3-5% longer on FastTree's trees 4 and 6: BENCHMARKS, session 9.)
__device__ __forceinline__ void attend_rows_wg(STAGE1_PARAMS, const GroupDesc& cd, int kvh, unsigned char* smem_raw) {
    constexpr int WT = 64, HALF = WT * 64;
    u16* base = reinterpret_cast<u16*>(smem_raw);
    auto k_of = [&](int st) { return base + st * 4 * HALF; };
    auto v_of = [&](int st) { return base + st * 4 * HALF + 2 * HALF; };
    const int gsz = q_heads / kv_heads;
    const int warp = threadIdx.x / 32;
    KvStream<CHUNKS, WT, 2, true> kv;
    kv.start(kc, vc, ranges, page_table, page_shift, kv_heads, kvh, cd);
    const u32 tiles = (cd.tokens + WT - 1) / WT;
    kv.issue_or_skip(k_of(0), v_of(0), 0, tiles);
    const int rows = min((int)cd.query_count * gsz, CTA_ROWS);
    const int row0 = warp * 16;
    const u64* mask = cd.mask_plus1 ? masks + cd.mask_plus1 - 1 : nullptr;
    u32 qa[KCH][4];
    load_q(qa, q, group_queries, cd, rows, row0, kvh, gsz, q_heads, scale_log2);
    float o[DTILES][4], m[2], l[2];
    clear_state(o, m, l);
    // Stage 0's descriptors; stage 1's lie 8 * HALF bytes on.
    const u64 k_desc0 = smem_desc(k_of(0), 16, 1024), v_desc0 = smem_desc(v_of(0), 2 * HALF, 1024);
    for (u32 tile = 0; tile < tiles; ++tile) {
        // The next tile goes into the other stage, which every warp finished with before the
        // barrier that ended the previous tile; then this tile is waited for.
        const int st = tile % 2;
        const u64 k_desc = desc_plus(k_desc0, st * 8 * HALF), v_desc = desc_plus(v_desc0, st * 8 * HALF);
        kv.issue_or_skip(k_of(st ^ 1), v_of(st ^ 1), tile + 1, tiles);
        asm volatile("cp.async.wait_group 1;\n" ::: "memory");
        // The MMA reads shared memory through the async proxy: this thread's copies must be
        // visible to it before the barrier.
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
        float s[8][4] = {};
        wg_fence();
#pragma unroll
        for (int c = 0; c < KCH; ++c)
            wg_qk(s, qa[c], desc_plus(k_desc, ((c / 4) * HALF + (c % 4) * 16) * 2), c);
        wg_commit_and_wait();
        wg_pin_all(s);
        if (mask || tile * WT + WT > cd.tokens) {
            u64 w[2];
            row_mask_bits<8>(w, mask, tile * WT, cd.query_count, row0, gsz);
            mask_scores(s, tile * WT, cd.tokens, w);
        }
        softmax_step(s, o, m, l);
        wg_pin_all(o);
        // P's fragments before the fence: registers written between two of a batch's MMAs
        // make the compiler insert waits.
        u32 a[4][4];
#pragma unroll
        for (int j = 0; j < 4; ++j) p_fragment(a[j], s, j);
        wg_fence();
#pragma unroll
        for (int j = 0; j < 4; ++j) wg_pv(o, a[j], desc_plus(v_desc, j * 16 * 64 * 2));
        wg_commit_and_wait();
        wg_pin_all(o);
        __syncthreads();
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    finish_l(l);
    write_rows(o, m, l, out_o, out_lse, cd.partial_base, rows, row0, kvh, gsz, q_heads);
}
#endif

// Groups of at most 16 rows (a leaf's query x its GQA rows; any one query under MHA) would
// leave three of four warps splitting a few tokens and merging through shared memory. Here a
// CTA takes HEADS_PER_CTA consecutive KV heads of one group instead, one warp per head: each
// warp streams all of the group's tokens for its own head and writes its rows from registers.
// A token's HEADS_PER_CTA head rows are contiguous, so every tile row is one coalesced copy.
#ifndef HEADS_PER_CTA
#error "HEADS_PER_CTA must be defined by the kernel registry"
#endif
static_assert(HEADS_PER_CTA == WARPS, "one warp per head");
// Tokens per tile: one k-chunk of P V.
#ifndef HEADS_TILE
#error "HEADS_TILE must be defined by the kernel registry"
#endif
// Two stages: three or four (one or two more tiles in flight) measured slower on FastTree's
// trees (docs/BENCHMARKS.md, session 6): their shared memory leaves fewer CTAs resident per SM.
#ifndef HEADS_STAGES
#error "HEADS_STAGES must be defined by the kernel registry"
#endif

struct HeadStage {
    u16 k[HEADS_PER_CTA][HEADS_TILE][STRIDE];
    u16 v[HEADS_PER_CTA][HEADS_TILE][STRIDE];
};

__device__ __forceinline__ void attend_heads(STAGE1_PARAMS, const GroupDesc& cd, int kvh0, unsigned char* smem_raw) {
    HeadStage* stage_mem = reinterpret_cast<HeadStage*>(smem_raw);  // HEADS_STAGES stages
    const int warp = threadIdx.x / 32;
    const int kvh = kvh0 + warp;
    const int gsz = q_heads / kv_heads;

    KvStream<CHUNKS * HEADS_PER_CTA, HEADS_TILE, HEADS_STAGES> kv;
    kv.start(kc, vc, ranges, page_table, page_shift, kv_heads, kvh0, cd);
    const u32 tiles = (cd.tokens + HEADS_TILE - 1) / HEADS_TILE;
#pragma unroll
    for (int s = 0; s + 1 < HEADS_STAGES; ++s)
        kv.issue_or_skip(&stage_mem[s].k[0][0][0], &stage_mem[s].v[0][0][0], s, tiles);

    const int rows = min((int)cd.query_count * gsz, HEADS_ROWS);
    const u64* mask = cd.mask_plus1 ? masks + cd.mask_plus1 - 1 : nullptr;
    u32 qa[KCH][4];
    load_q(qa, q, group_queries, cd, rows, 0, kvh, gsz, q_heads, scale_log2);
    float o[DTILES][4], m[2], l[2];
    clear_state(o, m, l);

    for (u32 tile = 0; tile < tiles; ++tile) {
        HeadStage& next = stage_mem[(tile + HEADS_STAGES - 1) % HEADS_STAGES];
        kv.next(&next.k[0][0][0], &next.v[0][0][0], tile, tiles);
        const HeadStage& st = stage_mem[tile % HEADS_STAGES];
        const u32 first = tile * HEADS_TILE;
        const bool edge = mask || first + HEADS_TILE > cd.tokens;
        attend<HEADS_TILE>(st.k[warp], st.v[warp], qa, o, m, l, first, edge, cd.tokens, mask, cd.query_count, 0, gsz);
        __syncthreads();
    }
    finish_l(l);
    write_rows(o, m, l, out_o, out_lse, cd.partial_base, rows, 0, kvh, gsz, q_heads);
}

// Stage 1 on tensor cores for a whole plan in one launch. CTA i runs descriptor i of `groups`
// (CTA_WORDS each): a group and its first KV head, and whether it runs many rows on one head
// (`attend_rows_wg` or `attend_rows`) or one warp per head (`attend_heads`, HEADS_PER_CTA heads). The host orders the items longest first, so that
// the long CTAs start in the first wave and the short ones fill in behind them.
//
// (Merging in the CTA that writes a query's last partial row, instead of in merge_partials,
// measured slower on every FastTree tree on H100: those CTAs are the short ones at the end, and
// their merges' dependent loads stretch the tail. docs/BENCHMARKS.md, session 7.)
// Descriptor head-word flag: the one-warp-per-head path (the bits below it: the first KV head).
#ifndef CTA_PER_HEAD
#error "CTA_PER_HEAD must be defined by the kernel registry"
#endif
// The host gives every CTA at least the one-warp-per-head path's stages of shared memory.
static_assert(!WGMMA || HEADS_STAGES * sizeof(HeadStage) >= 2 * 2 * 64 * HEAD_DIM * 2,
              "the warpgroup path's two 64-token stages fit in a CTA's shared memory");
extern "C" __global__ void __launch_bounds__(THREADS, MIN_CTAS)
decode_partial_mma(STAGE1_PARAMS) {
    let_next_grid_launch();
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const GroupDesc cd = read_cta(groups, blockIdx.x);
    // A place past the plan's own CTAs (room for larger plans written over it): no work.
    if (cd.query_count == 0) return;
    const int kvh0 = (int)(cd.head & (CTA_PER_HEAD - 1u));
    const bool per_head = cd.head & CTA_PER_HEAD;
    if (per_head)
        attend_heads(kc, vc, q, groups, ranges, group_queries, masks, page_table, page_shift, out_o, out_lse,
                     q_heads, kv_heads, scale_log2, cd, kvh0, smem_raw);
#if WGMMA
    // (The swizzled tiles need the stages on 1024 bytes, as dynamic shared memory starts.)
    else if ((int)cd.query_count * (q_heads / kv_heads) >= WG_MIN_ROWS && !((u32)__cvta_generic_to_shared(smem_raw) & 1023u))
        attend_rows_wg(kc, vc, q, groups, ranges, group_queries, masks, page_table, page_shift, out_o, out_lse,
                       q_heads, kv_heads, scale_log2, cd, kvh0, smem_raw);
#endif
    else
        attend_rows(kc, vc, q, groups, ranges, group_queries, masks, page_table, page_shift, out_o, out_lse,
                    q_heads, kv_heads, scale_log2, cd, kvh0, smem_raw);
}
