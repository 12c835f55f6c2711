// Device-side random data, bit-identical to canopy_core::data::hash_uniform on the host, so a
// multi-gigabyte KV cache is made on the GPU and the f64 oracle regenerates it on the CPU
// instead of copying it back. Also a read-only sweep for evicting L2 with clean lines, and the
// page-table copy between paged KV and contiguous storage.

__device__ __forceinline__ u64 splitmix64(u64 x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

// Uniform in [-1, 1) on a 2^-23 grid (exact in f32), times `amp`.
__device__ __forceinline__ float hash_uniform(u64 seed, u32 stream, u64 i, float amp) {
    const u64 h = splitmix64(seed ^ ((u64)stream << 56) ^ i);
    return ((float)(u32)(h >> 40) * (1.0f / 8388608.0f) - 1.0f) * amp;
}

// Elements first .. first + n of a tensor (so a rank can fill its shard of a global tensor).
extern "C" __global__ void fill_random(void* out, u64 n, u64 first, u64 seed, u32 stream, float amp) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const float x = hash_uniform(seed, stream, first + i, amp);
#if CANOPY_DTYPE == 0
        ((float*)out)[i] = x;
#elif CANOPY_DTYPE == 1
        ((u16*)out)[i] = f32_to_f16_rn(x);
#else
        ((u16*)out)[i] = f32_to_bf16_rn(x);
#endif
    }
}

// Reads n 16-byte words and writes `sink` only if one is nonzero (never, over a zeroed
// buffer): `--cache cold-clean` evicts L2 with it, leaving clean lines where a write leaves
// dirty ones.
extern "C" __global__ void read16(const uint4* __restrict__ src, u64 n, u32* __restrict__ sink) {
    u32 x = 0;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const uint4 v = src[i];
        x |= v.x | v.y | v.z | v.w;
    }
    if (x) *sink = x;
}

// Whole pages of paged KV to or from contiguous storage in logical order, one block per page:
// logical page first_page + blockIdx.x sits at physical page table[...] of `pool`, and at byte
// blockIdx.x * page_bytes of `flat` (`bytes` long in all: the last page may be partial).
// `scatter` 1 writes the pool, 0 reads it. Pages are whole 16-byte words.
extern "C" __global__ void copy_pages(unsigned char* __restrict__ pool, unsigned char* __restrict__ flat,
                                      const u32* __restrict__ table, u64 first_page,
                                      u64 page_bytes, u64 bytes, u32 scatter) {
    const u64 at = blockIdx.x * page_bytes;
    const u64 len = min(page_bytes, bytes - at);
    uint4* paged = (uint4*)(pool + (u64)table[first_page + blockIdx.x] * page_bytes);
    uint4* dense = (uint4*)(flat + at);
    for (u64 i = threadIdx.x; i < len / 16; i += blockDim.x) {
        if (scatter) paged[i] = dense[i];
        else dense[i] = paged[i];
    }
}
