// The warp-level pieces of attention on tensor cores (mma.sync.m16n8k16), shared by the decode
// kernel (decode_mma.cu) and the prefill kernel (prefill.cu); NVRTC compiles those files with
// this one prepended after common.cuh.
//
// A warp owns 16 rows (queries x GQA heads): lane l holds rows g = l / 4 and g + 8 and, of each
// 8-column n-tile, columns 2 (l % 4) and 2 (l % 4) + 1 (the mma accumulator layout). Q is held as
// A fragments in registers, pre-scaled into the log2 domain; K and V come from shared-memory rows
// of HEAD_DIM + MMA_ROW_PAD elements by ldmatrix; the softmax is online, in fp32.
//
// Compile-time parameters: CANOPY_DTYPE (1 = f16, 2 = bf16), HEAD_DIM (64 or 128).

#ifndef HEAD_DIM
#error "HEAD_DIM must be defined by the kernel registry"
#endif
// Shared-memory rows are padded by MMA_ROW_PAD elements (16 bytes).
#ifndef MMA_ROW_PAD
#error "MMA_ROW_PAD must be defined by the kernel registry"
#endif
#define STRIDE (HEAD_DIM + MMA_ROW_PAD)  // elements per shared-memory row
#define KCH (HEAD_DIM / 16)    // k-chunks of Q K^T
#define DTILES (HEAD_DIM / 8)  // n-tiles of P V
#if CANOPY_DTYPE == 1
#define MMA_AB "f16"
#else
#define MMA_AB "bf16"
#endif

// C += A B on the tensor cores: A 16 x 16 (row), B 16 x 8 (col), C 16 x 8 in fp32.
__device__ __forceinline__ void mma16816(float c[4], const u32 a[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32." MMA_AB "." MMA_AB ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four 8x8 matrices of 16-bit elements from shared memory (transposed with Trans), one
// register each; lane i gives the address of row i % 8 of matrix i / 8.
template <bool Trans>
__device__ __forceinline__ void ldsm_x4(u32 r[4], const u16* p) {
    const u32 a = (u32)__cvta_generic_to_shared(p);
    if constexpr (Trans)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a) : "memory");
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a) : "memory");
}

// A warp's online-softmax state for its 16 rows, empty.
__device__ __forceinline__ void clear_state(float (&o)[DTILES][4], float (&m)[2], float (&l)[2]) {
#pragma unroll
    for (int d = 0; d < DTILES; ++d)
#pragma unroll
        for (int i = 0; i < 4; ++i) o[d][i] = 0.f;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        m[h] = NEG_INF;
        l[h] = 0.f;
    }
}

// How far (log2 units) a row's scores may rise past the max its state is scaled to before the
// state moves to the new max: until then P = exp2(s - m) stays at most 2^RESCALE_SLACK, which
// fp32 sums and 16-bit P hold as well as values up to 1, and O is not rescaled. A state is exact
// for any m (o and l are sums of exp2(s - m), lse is m + log2 l), so the slack changes rounding
// only. A max that followed every score would have O rescaled on nearly every tile of a short
// split: some row of a warp's 16 finds a new max on most of a CTA's first tiles.
#define RESCALE_SLACK 8.f

// The online softmax over one slice of scores (already in the log2 domain): the state's max
// moves where a score passes it by more than RESCALE_SLACK, the scores become P, and alpha is
// the factor O must be rescaled by, 1 where the max held (O itself is not touched: a
// warpgroup MMA may still be accumulating into it).
template <int NT>
__device__ __forceinline__ void softmax_scores(float (&s)[NT][4], float (&m)[2], float (&l)[2], float (&alpha)[2]) {
    // Maxima and sums in pairwise trees over CH partials: chains of dependent instructions as
    // short as they go (the "wait" stall led the tensor-core kernels' profile, BENCHMARKS
    // session 9). Past 8 n-tiles the partials first gather NT / CH n-tiles each: the halving
    // loop of a wider tree is not unrolled, and its partials would live in local memory.
    constexpr int CH = NT > 8 ? 8 : NT;
    float part[2][CH];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        const float lo = fmaxf(s[nt][0], s[nt][1]), hi = fmaxf(s[nt][2], s[nt][3]);
        part[0][nt % CH] = nt < CH ? lo : fmaxf(part[0][nt % CH], lo);
        part[1][nt % CH] = nt < CH ? hi : fmaxf(part[1][nt % CH], hi);
    }
#pragma unroll
    for (int w = CH / 2; w >= 1; w /= 2)
#pragma unroll
        for (int j = 0; j < w; ++j) {
            part[0][j] = fmaxf(part[0][j], part[0][j + w]);
            part[1][j] = fmaxf(part[1][j], part[1][j + w]);
        }
    float mx[2] = {part[0][0], part[1][0]};
    float base[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
        // (Also the first finite score of a row: alpha = exp2(-inf) = 0 clears its empty state.)
        alpha[h] = 1.f;
        if (mx[h] > m[h] + RESCALE_SLACK) {
            alpha[h] = fast_exp2(m[h] - mx[h]);
            m[h] = mx[h];
            l[h] *= alpha[h];
        }
        // A row with nothing seen yet subtracts 0 instead of -inf (exp2(-inf) = 0 follows).
        base[h] = m[h] == NEG_INF ? 0.f : m[h];
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) s[nt][i] = fast_exp2(s[nt][i] - base[i >> 1]);
        const float lo = s[nt][0] + s[nt][1], hi = s[nt][2] + s[nt][3];
        part[0][nt % CH] = nt < CH ? lo : part[0][nt % CH] + lo;
        part[1][nt % CH] = nt < CH ? hi : part[1][nt % CH] + hi;
    }
#pragma unroll
    for (int w = CH / 2; w >= 1; w /= 2)
#pragma unroll
        for (int j = 0; j < w; ++j) {
            part[0][j] += part[0][j + w];
            part[1][j] += part[1][j + w];
        }
    l[0] += part[0][0];
    l[1] += part[1][0];
}

// O rescaled by softmax_scores' alpha: a state's max moves on a row's first scores and then
// only where one passes it by more than RESCALE_SLACK, so only when some row's did.
__device__ __forceinline__ void rescale(float (&o)[DTILES][4], const float (&alpha)[2]) {
    if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
        for (int d = 0; d < DTILES; ++d) {
            o[d][0] *= alpha[0];
            o[d][1] *= alpha[0];
            o[d][2] *= alpha[1];
            o[d][3] *= alpha[1];
        }
    }
}

// One online-softmax step: the scores become P, and O is rescaled to the new running max.
template <int NT>
__device__ __forceinline__ void softmax_step(float (&s)[NT][4], float (&o)[DTILES][4], float (&m)[2], float (&l)[2]) {
    float alpha[2];
    softmax_scores(s, m, l, alpha);
    rescale(o, alpha);
}

// P of 16 tokens (S n-tiles 2c and 2c + 1) as an A fragment of P V.
template <int NT>
__device__ __forceinline__ void p_fragment(u32 (&a)[4], const float (&s)[NT][4], int c) {
    a[0] = pack2(s[2 * c][0], s[2 * c][1]);
    a[1] = pack2(s[2 * c][2], s[2 * c][3]);
    a[2] = pack2(s[2 * c + 1][0], s[2 * c + 1][1]);
    a[3] = pack2(s[2 * c + 1][2], s[2 * c + 1][3]);
}

// Quad totals of l (each thread summed only its own columns of the scores).
__device__ __forceinline__ void finish_l(float (&l)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    }
}

// S = Q K^T for NT n-tiles of 8 tokens: rows `k[0..8 NT)` of a shared-memory tile.
template <int NT>
__device__ __forceinline__ void qk_scores(float (&s)[NT][4], const u16 (*k)[STRIDE], const u32 (&qa)[KCH][4]) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) s[nt][i] = 0.f;
#pragma unroll
    for (int c = 0; c < KCH; c += 2) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            u32 b[4];
            ldsm_x4<false>(b, &k[nt * 8 + (lane & 7)][c * 16 + (lane >> 3) * 8]);
            mma16816(s[nt], qa[c], b[0], b[1]);
            mma16816(s[nt], qa[c + 1], b[2], b[3]);
        }
    }
}

// O += P V for the NT n-tiles of P (after softmax_step) and rows `v[0..8 NT)` of a tile, 16
// tokens (two n-tiles of P) per k-chunk.
template <int NT>
__device__ __forceinline__ void pv_accumulate(float (&o)[DTILES][4], const float (&s)[NT][4], const u16 (*v)[STRIDE]) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int c = 0; c < NT / 2; ++c) {
        u32 a[4];
        p_fragment(a, s, c);
        const int vt = c * 16 + ((lane >> 3) & 1) * 8 + (lane & 7);
#pragma unroll
        for (int d = 0; d < DTILES; d += 2) {
            u32 b[4];
            ldsm_x4<true>(b, &v[vt][(d + (lane >> 4)) * 8]);
            mma16816(o[d], a, b[0], b[1]);
            mma16816(o[d + 1], a, b[2], b[3]);
        }
    }
}

// The warpgroup MMA, on Hopper (sm_90a) for heads of 128.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) && HEAD_DIM == 128
#define HAS_WGMMA 1
#else
#define HAS_WGMMA 0
#endif

#if HAS_WGMMA
// Warpgroup MMA (Hopper's wgmma): the CTA's four warps are one warpgroup and multiply 64 rows
// at a time. A (Q, or P) comes from registers in the same per-warp fragments as mma.sync's
// m16n8k16 (warp w holds rows 16w..16w+15), and so do the f32 accumulators, per 8 columns; B
// (K, or V) is read by the tensor cores straight from the shared-memory tile, described by a
// 64-bit matrix descriptor, with no ldmatrix through registers.

// Descriptor of a 128-byte-swizzled tile (KvStream<..., true>): start address, then the byte
// offsets between 64-element blocks (leading) and between 8-row groups (stride), all in
// 16-byte units, and the swizzle mode. The swizzle XORs address bits 4-6 with bits 7-9, so a
// tile must start on 1024 bytes.
__device__ __forceinline__ u64 smem_desc(const u16* p, u32 leading, u32 stride) {
    const u32 a = (u32)__cvta_generic_to_shared(p);
    return (u64)((a & 0x3ffffu) >> 4) | (u64)(leading >> 4) << 16 | (u64)(stride >> 4) << 32 | 1ull << 62;
}

// The descriptor of the same layout `bytes` further on (a multiple of 16): one add to the low
// word, whose start-address field (bits 0-13, in 16-byte units) takes it with no carry, since a
// CTA's shared memory lies in its window's first 256 KB. The decode kernel's warpgroup path
// makes each stage's descriptors once and steps them per MMA so: built afresh from an address,
// a descriptor costs about ten instructions an MMA (mask, shift, or, moves to the uniform
// registers), and that path, bound by its instructions' latency, took 1-5% less on the serving
// trees. The prefill kernel, bound by the tensor cores, was no faster so (BENCHMARKS, session
// 46).
__device__ __forceinline__ u64 desc_plus(u64 desc, u32 bytes) {
    return (desc & ~0xffffffffull) | (u32)((u32)desc + (bytes >> 4));
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most `Pending` of this warp's committed MMA batches are still running.
template <int Pending>
__device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(Pending) : "memory");
}
__device__ __forceinline__ void wg_commit_and_wait() {
    wg_commit();
    wg_wait<0>();
}

// Shared-memory barriers (mbarrier) and bulk copies, for kernels whose loads one thread issues
// while other warpgroups compute: a copy completes on a barrier by the bytes it lands, so a
// consumer waits on the barrier's phase and never on the copy itself.
__device__ __forceinline__ u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(u64* bar, u32 arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(arrivals) : "memory");
}
// Makes the barriers' initialisation visible to the async proxy (the bulk copies).
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
__device__ __forceinline__ void mbar_arrive(u64* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
// Arrives and sets the barrier's phase to also wait for `bytes` of copies.
__device__ __forceinline__ void mbar_expect_bytes(u64* bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
// Waits for the barrier's phase of parity `parity` to complete.
__device__ __forceinline__ void mbar_wait(u64* bar, u32 parity) {
    asm volatile(
        "{\n.reg .pred done;\nWAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n}\n" ::"r"(smem_u32(bar)), "r"(parity)
        : "memory");
}
// `bytes` (a multiple of 16, both addresses on 16 bytes) from global to shared memory by the
// copy engine, completing on `bar`.
__device__ __forceinline__ void bulk_copy(void* smem, const void* gmem, u32 bytes, u64* bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(smem_u32(smem)),
        "l"(gmem), "r"(bytes), "r"(smem_u32(bar))
        : "memory");
}
// The warpgroup's registers per thread, lowered (for a warpgroup that only issues copies) or
// raised (for one that computes); ptxas allocates the code that follows within the new count.
template <u32 Regs>
__device__ __forceinline__ void regs_lower() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(Regs)); }
template <u32 Regs>
__device__ __forceinline__ void regs_raise() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(Regs)); }
// Keeps the compiler from moving an accumulator's reads or writes across an asynchronous MMA.
__device__ __forceinline__ void wg_pin(float& r) { asm volatile("" : "+f"(r)::"memory"); }

// Pins every accumulator of a fragment array (S's n-tiles or O's).
template <int N>
__device__ __forceinline__ void wg_pin_all(float (&r)[N][4]) {
#pragma unroll
    for (int n = 0; n < N; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) wg_pin(r[n][i]);
}

// The four accumulator registers of n-tile `i` of `acc`, as read-write asm operands.
#define WG_ACC4(acc, i) "+f"(acc[i][0]), "+f"(acc[i][1]), "+f"(acc[i][2]), "+f"(acc[i][3])

// S (64 rows x 64 tokens) (+)= Q (k16 chunk) K^T: B is K-major (HEAD_DIM contiguous per token).
__device__ __forceinline__ void wg_qk(float (&s)[8][4], const u32 (&a)[4], u64 desc, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32." MMA_AB "." MMA_AB " "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
        : WG_ACC4(s, 0), WG_ACC4(s, 1), WG_ACC4(s, 2), WG_ACC4(s, 3), WG_ACC4(s, 4), WG_ACC4(s, 5),
          WG_ACC4(s, 6), WG_ACC4(s, 7)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate));
}

// S (64 rows x 128 tokens) (+)= Q (k16 chunk) K^T with both operands in shared memory: A is
// K-major like B, described as wg_qk's B is.
__device__ __forceinline__ void wg_qk128_ss(float (&s)[16][4], u64 a_desc, u64 b_desc, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32." MMA_AB "." MMA_AB " "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "%64, %65, p, 1, 1, 0, 0;\n}\n"
        : WG_ACC4(s, 0), WG_ACC4(s, 1), WG_ACC4(s, 2), WG_ACC4(s, 3), WG_ACC4(s, 4), WG_ACC4(s, 5),
          WG_ACC4(s, 6), WG_ACC4(s, 7), WG_ACC4(s, 8), WG_ACC4(s, 9), WG_ACC4(s, 10), WG_ACC4(s, 11),
          WG_ACC4(s, 12), WG_ACC4(s, 13), WG_ACC4(s, 14), WG_ACC4(s, 15)
        : "l"(a_desc), "l"(b_desc), "r"(accumulate));
}

// O (64 rows x 128) += P (k16 chunk of tokens) V: B is MN-major (HEAD_DIM contiguous per
// token, transposed by the instruction).
__device__ __forceinline__ void wg_pv(float (&o)[DTILES][4], const u32 (&a)[4], u64 desc) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n128k16.f32." MMA_AB "." MMA_AB " "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "{%64, %65, %66, %67}, %68, 1, 1, 1, 1;\n"
        : WG_ACC4(o, 0), WG_ACC4(o, 1), WG_ACC4(o, 2), WG_ACC4(o, 3), WG_ACC4(o, 4), WG_ACC4(o, 5),
          WG_ACC4(o, 6), WG_ACC4(o, 7), WG_ACC4(o, 8), WG_ACC4(o, 9), WG_ACC4(o, 10), WG_ACC4(o, 11),
          WG_ACC4(o, 12), WG_ACC4(o, 13), WG_ACC4(o, 14), WG_ACC4(o, 15)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
#endif
