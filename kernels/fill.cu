// Device-side random data, bit-identical to canopy_core::data::hash_uniform on the host, so a
// multi-gigabyte KV cache is made on the GPU and the f64 oracle regenerates it on the CPU
// instead of copying it back. Also a poison fill and a copy kernel for the bandwidth ceiling.

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

// Device-to-device copy with 16-byte accesses: the bandwidth ceiling the benchmarks divide by.
extern "C" __global__ void copy16(const uint4* __restrict__ src, uint4* __restrict__ dst, u64 n) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        dst[i] = src[i];
}
