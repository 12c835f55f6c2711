// Helpers of the standalone kernel benches (gemv_bench.cu, gemm_tma_bench.cu), included after
// the crate's common.cuh: a CUDA call checked (check.cuh), and a weight filled with
// reproducible bf16 values.
#pragma once
#include "check.cuh"

// n bf16 values hashed from their index and `seed`, uniform in [-scale / 2, scale / 2).
__global__ void fill_random(u16* w, u64 n, u32 seed, float scale) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        u32 h = (u32)i * 2654435761u ^ seed;
        h ^= h >> 15;
        h *= 2246822519u;
        h ^= h >> 13;
        w[i] = f32_to_bf16_rn(((float)(h & 0xFFFF) / 65536.f - 0.5f) * scale);
    }
}
