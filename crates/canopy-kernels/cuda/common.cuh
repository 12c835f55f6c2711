// Helpers shared by canopy's kernels. NVRTC compiles each kernel file with this file prepended
// (no include paths and no CUDA headers needed at run time).
//
// Element types are selected with -DCANOPY_DTYPE: 0 = f32, 1 = f16, 2 = bf16. Conversions are
// written in PTX / integer ops so the kernels need neither cuda_fp16.h nor cuda_bf16.h.
//
// Numbers the host shares with the kernels (descriptor layouts, flags, thread counts, tiles)
// are defined once in Rust and given to every compile as defines by the kernel registry
// (canopy-kernels); the files only check for them, so none is written twice.

#ifndef CANOPY_DTYPE
#error "CANOPY_DTYPE must be defined by the kernel registry"
#endif

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define NEG_INF __int_as_float(0xff800000)
#define LN2 0.69314718055994530942f

__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f32_to_f16_rn(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// Round-to-nearest-even to bf16 (finite inputs), as the `half` crate does on the host.
__device__ __forceinline__ u16 f32_to_bf16_rn(float f) {
    u32 u = __float_as_uint(f);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (u16)(u >> 16);
}

// `x` rounded to the 16-bit type of code `dtype` (1: f16, 2: bf16, as CANOPY_DTYPE), for
// kernels compiled once for fp32 that also write a 16-bit copy of their output.
__device__ __forceinline__ u16 round_to16(float x, u32 dtype) {
    return dtype == 1 ? f32_to_f16_rn(x) : f32_to_bf16_rn(x);
}

// A float4 rounded to the 16-bit type of code `dtype` into `out` (8-byte aligned).
__device__ __forceinline__ void store_rounded4(u16* out, float4 x, u32 dtype) {
    const u32 lo = round_to16(x.x, dtype) | (u32)round_to16(x.y, dtype) << 16;
    const u32 hi = round_to16(x.z, dtype) | (u32)round_to16(x.w, dtype) << 16;
    *reinterpret_cast<uint2*>(out) = make_uint2(lo, hi);
}

#if CANOPY_DTYPE != 0
// Two floats rounded to the 16-bit element type in one 32-bit word, `lo` in the low half (the
// lower column of an MMA fragment).
__device__ __forceinline__ u32 pack2(float lo, float hi) {
    u32 r;
#if CANOPY_DTYPE == 1
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
#else
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
#endif
    return r;
}
#endif

// Eight consecutive elements of one KV row, raw.
struct Raw8 {
    uint4 a;
#if CANOPY_DTYPE == 0
    uint4 b;
#endif
};

#if CANOPY_DTYPE == 0
#define ELEM_BYTES 4
#else
#define ELEM_BYTES 2
#endif

__device__ __forceinline__ void widen8(const Raw8& r, float out[8]) {
#if CANOPY_DTYPE == 0
    out[0] = __uint_as_float(r.a.x); out[1] = __uint_as_float(r.a.y);
    out[2] = __uint_as_float(r.a.z); out[3] = __uint_as_float(r.a.w);
    out[4] = __uint_as_float(r.b.x); out[5] = __uint_as_float(r.b.y);
    out[6] = __uint_as_float(r.b.z); out[7] = __uint_as_float(r.b.w);
#elif CANOPY_DTYPE == 1
    const u32 w[4] = {r.a.x, r.a.y, r.a.z, r.a.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        out[2 * i] = f16_to_f32((u16)(w[i] & 0xffffu));
        out[2 * i + 1] = f16_to_f32((u16)(w[i] >> 16));
    }
#else
    const u32 w[4] = {r.a.x, r.a.y, r.a.z, r.a.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        out[2 * i] = __uint_as_float(w[i] << 16);
        out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
#endif
}

// Group descriptor flag (GROUP_KV_STREAMED in canopy-kernels): other groups read none of
// this group's KV, or few of its tokens. Its loads then go first out of L2 (evict_first): streaming
// it through L2 pushes out KV the step has already used, not lines that outlive it (the
// partials kept for the merge, other kernels' data, dirty lines whose write-back the step would
// otherwise pay for). KV that other groups read too is loaded without a hint, so that they find
// it in L2: evict_first on a root that 64 CTAs read (FastTree's tree 4) made the step 1-4%
// longer, and an explicit evict_normal policy made Q-guided plans up to 38% longer
// (BENCHMARKS, session 11).
#ifndef GROUP_KV_STREAMED
#error "GROUP_KV_STREAMED must be defined by the kernel registry"
#endif

// A 16-byte cp.async global -> shared copy of `bytes` (0 or 16) source bytes, the rest zero
// filled, with the 256-byte L2 prefetch hint (KV rows are read whole), as first to leave L2
// when `evict_first` (GROUP_KV_STREAMED).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, u32 bytes, bool evict_first) {
    const u32 dst = (u32)__cvta_generic_to_shared(smem);
    if (evict_first) {
        u64 p;
        asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
        asm volatile("cp.async.cg.shared.global.L2::cache_hint.L2::256B [%0], [%1], 16, %2, %3;\n" ::"r"(dst),
                     "l"(gmem), "r"(bytes), "l"(p));
    } else {
        asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(bytes));
    }
}

// Partials' L2 priorities (sm_80 and later; plain accesses before). Stage 1 stores its
// partials to be kept in L2 (evict_last) until the merge reads them: with the default priority,
// the KV streaming through stage 1 pushed them out to DRAM and the merge read them back. The
// merge loads them as first to go (evict_first), so they do not outlive the step. (A plan that
// skips the merge leaves its outputs kept: the next layer reads them.)
__device__ __forceinline__ u64 l2_policy(bool keep) {
    u64 p = 0;
#if __CUDA_ARCH__ >= 800
    if (keep) asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(p));
    else asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
#endif
    return p;
}

__device__ __forceinline__ void store_kept(float* a, float x, u64 policy) {
#if __CUDA_ARCH__ >= 800
    asm volatile("st.global.L2::cache_hint.f32 [%0], %1, %2;" ::"l"(a), "f"(x), "l"(policy) : "memory");
#else
    *a = x;
#endif
}

__device__ __forceinline__ void store_kept(float2* a, float2 x, u64 policy) {
#if __CUDA_ARCH__ >= 800
    asm volatile("st.global.L2::cache_hint.v2.f32 [%0], {%1, %2}, %3;" ::"l"(a), "f"(x.x), "f"(x.y), "l"(policy)
                 : "memory");
#else
    *a = x;
#endif
}

__device__ __forceinline__ void store_kept(float4* a, float4 x, u64 policy) {
#if __CUDA_ARCH__ >= 800
    asm volatile("st.global.L2::cache_hint.v4.f32 [%0], {%1, %2, %3, %4}, %5;" ::"l"(a), "f"(x.x), "f"(x.y),
                 "f"(x.z), "f"(x.w), "l"(policy)
                 : "memory");
#else
    *a = x;
#endif
}

__device__ __forceinline__ float load_dropped(const float* a, u64 policy) {
#if __CUDA_ARCH__ >= 800
    float x;
    asm("ld.global.L2::cache_hint.f32 %0, [%1], %2;" : "=f"(x) : "l"(a), "l"(policy));
    return x;
#else
    return *a;
#endif
}

__device__ __forceinline__ float4 load_dropped(const float4* a, u64 policy) {
#if __CUDA_ARCH__ >= 800
    float4 x;
    asm("ld.global.L2::cache_hint.v4.f32 {%0, %1, %2, %3}, [%4], %5;"
                 : "=f"(x.x), "=f"(x.y), "=f"(x.z), "=f"(x.w)
                 : "l"(a), "l"(policy));
    return x;
#else
    return *a;
#endif
}

// A masked group's mask as the kernels read it (the host lays it out from the plan's
// token-major one; a CTA's group has at most 64 queries): per 64-token block of the group's
// tokens, one word per query, bit t for the block's token t. So a thread that tests one
// query's tokens of a tile loads one word, not one per token. This is the address of query
// j's word for the block holding group-local token `local`.
__device__ __forceinline__ const u64* mask_word(const u64* mask, u32 local, u32 queries, u32 j) {
    return mask + (u64)(local / 64) * queries + j;
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Programmatic dependent launch (sm_90 and later; no-ops before). A stage-1 kernel lets the
// merge that follows it on the stream be scheduled as soon as all its own CTAs are running, so
// the merge's launch overlaps stage 1's last wave instead of following its drain; the merge
// then waits in `wait_for_previous_grid` until stage 1 has finished and its writes are visible.
__device__ __forceinline__ void let_next_grid_launch() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void wait_for_previous_grid() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// The parameters every stage-1 kernel takes (the host launches all three with one argument
// list): K and V bytes, queries, the plan's group descriptors, KV ranges, group query lists and
// masks, the page table (null: contiguous KV) and its page shift, the partial outputs, the
// head counts and the softmax scale times log2(e).
#define STAGE1_PARAMS                                                                            \
    const unsigned char *__restrict__ kc, const unsigned char *__restrict__ vc,                 \
        const float *__restrict__ q, const u32 *__restrict__ groups,                            \
        const u32 *__restrict__ ranges, const u32 *__restrict__ group_queries,                  \
        const u64 *__restrict__ masks, const u32 *__restrict__ page_table, u32 page_shift,      \
        float *__restrict__ out_o, float *__restrict__ out_lse, int q_heads, int kv_heads,      \
        float scale_log2
