// Standalone timing of gemm.cu's few-row products on the Llama-3.1-8B projections (bf16) against
// cuBLAS as canopy calls it (cublasGemmEx, bf16 operands, fp32 output; for gate|up a bf16
// product, SwiGLU's kernel not counted), for kernel development on the device: built by
// launch/device/gemm-bench.sh with nvcc against the crate's sources.
//
// Each projection is timed at several row counts, cycling through enough copies of its weight
// that none is read from L2, with every cluster split (1, 2, 4, 8) and the split the host picks
// (`host_splits`, which must match canopy-cuda's `gemm_splits`). Each result is checked against
// cuBLAS's fp32 product (SwiGLU's on the host from cuBLAS's gate and up); the largest error
// relative to the output's largest magnitude is printed. Floor: the weight's bytes over the
// copy bandwidth measured here.
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <vector>

#include "common.cuh"
#include "gemm.cu"

#define CHECK(call)                                                                               \
    do {                                                                                          \
        cudaError_t e_ = (call);                                                                  \
        if (e_ != cudaSuccess) {                                                                  \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
            exit(1);                                                                              \
        }                                                                                         \
    } while (0)
#define CHECK_BLAS(x)                                                                 \
    do {                                                                              \
        int s_ = (int)(x);                                                            \
        if (s_ != 0) {                                                                \
            fprintf(stderr, "%s:%d cublas status %d\n", __FILE__, __LINE__, s_);      \
            exit(1);                                                                  \
        }                                                                             \
    } while (0)

__global__ void fill_random(u16* w, u64 n, u32 seed, float scale) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        u32 h = (u32)i * 2654435761u ^ seed;
        h ^= h >> 15; h *= 2246822519u; h ^= h >> 13;
        w[i] = f32_to_bf16_rn(((float)(h & 0xFFFF) / 65536.f - 0.5f) * scale);
    }
}

enum Kind { STORE, ADD, SWIGLU };
struct Shape {
    const char* name;
    Kind kind;
    u32 cols, k;  // output columns (SwiGLU: the weight has 2 cols rows)
};

// The cluster split canopy's host picks: the fewest waves of CTAs times chunks per CTA (plus
// one for a CTA's fixed cost), the smaller split on ties.
static u32 host_splits(u32 tiles, u32 chunks, u32 slots) {
    u32 best = 1;
    u64 best_cost = ~0ull;
    for (u32 s = 1; s <= 8; s *= 2) {
        const u64 waves = ((u64)tiles * s + slots - 1) / slots, per = (chunks + s - 1) / s;
        const u64 cost = waves * (per + 1);
        if (cost < best_cost) { best_cost = cost; best = s; }
    }
    return best;
}

int main(int argc, char** argv) {
    const int iters = argc > 1 ? atoi(argv[1]) : 100;
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    const Shape shapes[] = {
        {"qkv", STORE, 6144, 4096}, {"o", ADD, 4096, 4096}, {"gate_up", SWIGLU, 14336, 4096}, {"down", ADD, 4096, 14336}};
    const u32 row_counts[] = {16, 32, 64};
    cudaStream_t s;
    CHECK(cudaStreamCreate(&s));
    cublasHandle_t blas;
    CHECK_BLAS(cublasCreate(&blas));
    CHECK_BLAS(cublasSetStream(blas, s));
    cudaEvent_t t0, t1;
    CHECK(cudaEventCreate(&t0));
    CHECK(cudaEventCreate(&t1));
    auto time_it = [&](auto&& f) {
        for (int i = 0; i < 3; ++i) f(i);
        CHECK(cudaEventRecord(t0, s));
        for (int i = 0; i < iters; ++i) f(i);
        CHECK(cudaEventRecord(t1, s));
        CHECK(cudaEventSynchronize(t1));
        float ms;
        CHECK(cudaEventElapsedTime(&ms, t0, t1));
        return ms * 1000.f / iters;
    };
    // Copy bandwidth (read + written bytes).
    const size_t copy_bytes = 1ull << 30;
    void *src, *dst;
    CHECK(cudaMalloc(&src, copy_bytes));
    CHECK(cudaMalloc(&dst, copy_bytes));
    const float copy_us = time_it([&](int) { CHECK(cudaMemcpyAsync(dst, src, copy_bytes, cudaMemcpyDeviceToDevice, s)); });
    const double bw = 2.0 * copy_bytes / (copy_us * 1e-6);
    CHECK(cudaFree(src));
    CHECK(cudaFree(dst));
    // As canopy-kernels' gemm_shared_bytes.
    const size_t smem = std::max((size_t)GEMM_MAX_ROWS * GEMM_LD * 2, (size_t)GEMM_MAX_ROWS * GEMM_RED_LD * 4);
    CHECK(cudaFuncSetAttribute(gemm_rows, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    CHECK(cudaFuncSetAttribute(gemm_rows_add, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    CHECK(cudaFuncSetAttribute(gemm_rows_swiglu, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    int ctas_per_sm = 0;
    CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas_per_sm, gemm_rows, GEMM_THREADS, smem));
    cudaFuncAttributes attr;
    CHECK(cudaFuncGetAttributes(&attr, gemm_rows_swiglu));
    printf("%s, copy bandwidth %.0f GB/s; gemm_rows: %d CTAs/SM, swiglu %d registers, %zu local bytes, tile %d, "
           "phase %d, %zu bytes of shared memory\n",
           prop.name, bw / 1e9, ctas_per_sm, attr.numRegs, attr.localSizeBytes, GEMM_TILE, GEMM_PHASE, smem);
    printf("%-8s %5s %9s %9s %9s %9s %9s %9s %6s %9s %s\n", "proj", "rows", "floor us", "cublas", "s=1", "s=2", "s=4",
           "s=8", "host s", "host us", "max rel err (s=1,2,4,8)");
    const u64 min_bytes = 512ull << 20;
    for (const Shape& sh : shapes) {
        const u32 wrows = sh.kind == SWIGLU ? 2 * sh.cols : sh.cols;
        const u64 elems = (u64)wrows * sh.k, bytes = elems * 2;
        const int copies = (int)((min_bytes + bytes - 1) / bytes);
        u16* w;
        CHECK(cudaMalloc(&w, bytes * copies));
        fill_random<<<1024, 256, 0, s>>>(w, elems * copies, 17u, 0.05f);
        for (u32 rows : row_counts) {
            u16* x;
            float *ref, *out, *base;
            u16* out_narrow;
            CHECK(cudaMalloc(&x, (size_t)rows * sh.k * 2));
            CHECK(cudaMalloc(&ref, (size_t)rows * wrows * 4));
            CHECK(cudaMalloc(&out, (size_t)rows * sh.cols * 4));
            CHECK(cudaMalloc(&base, (size_t)rows * sh.cols * 4));
            CHECK(cudaMalloc(&out_narrow, (size_t)rows * wrows * 2));
            fill_random<<<256, 256, 0, s>>>(x, (u64)rows * sh.k, 7u + rows, 2.f);
            const float alpha = 1.f, zero = 0.f;
            // cuBLAS's fp32 product of weight copy 0: the reference.
            CHECK_BLAS(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, wrows, rows, sh.k, &alpha, w, CUDA_R_16BF, sh.k, x,
                                    CUDA_R_16BF, sh.k, &zero, ref, CUDA_R_32F, wrows, CUBLAS_COMPUTE_32F,
                                    CUBLAS_GEMM_DEFAULT));
            const float beta = sh.kind == ADD ? 1.f : 0.f;
            const float cublas_us = time_it([&](int i) {
                void* c = sh.kind == SWIGLU ? (void*)out_narrow : (void*)out;
                CHECK_BLAS(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, wrows, rows, sh.k, &alpha,
                                        w + (u64)(i % copies) * elems, CUDA_R_16BF, sh.k, x, CUDA_R_16BF, sh.k, &beta,
                                        c, sh.kind == SWIGLU ? CUDA_R_16BF : CUDA_R_32F, wrows, CUBLAS_COMPUTE_32F,
                                        CUBLAS_GEMM_DEFAULT));
            });
            std::vector<float> href((size_t)rows * wrows), hbase((size_t)rows * sh.cols), hout((size_t)rows * sh.cols);
            CHECK(cudaMemcpy(href.data(), ref, href.size() * 4, cudaMemcpyDeviceToHost));
            for (size_t i = 0; i < hbase.size(); ++i) hbase[i] = sinf(0.1f * (float)i);
            CHECK(cudaMemcpy(base, hbase.data(), hbase.size() * 4, cudaMemcpyHostToDevice));
            // The expected output, in fp32 on the host from cuBLAS's product.
            std::vector<double> want((size_t)rows * sh.cols);
            double scale = 0;
            for (u32 m = 0; m < rows; ++m)
                for (u32 n = 0; n < sh.cols; ++n) {
                    const double p = href[(size_t)n + (size_t)m * wrows];
                    double v = p;
                    if (sh.kind == ADD) v = hbase[(size_t)m * sh.cols + n] + p;
                    if (sh.kind == SWIGLU) {
                        const double u = href[(size_t)m * wrows + sh.cols + n];
                        v = p / (1.0 + exp(-p)) * u;
                    }
                    want[(size_t)m * sh.cols + n] = v;
                    scale = fmax(scale, fabs(v));
                }
            const u32 tile_cols = sh.kind == SWIGLU ? GEMM_TILE / 2 : GEMM_TILE;
            const u32 tiles = (sh.cols + tile_cols - 1) / tile_cols, chunks = (sh.k + GEMM_PHASE - 1) / GEMM_PHASE;
            auto launch = [&](u32 splits, const u16* wc) {
                cudaLaunchAttribute cluster;
                cluster.id = cudaLaunchAttributeClusterDimension;
                cluster.val.clusterDim.x = splits;
                cluster.val.clusterDim.y = 1;
                cluster.val.clusterDim.z = 1;
                cudaLaunchConfig_t cfg = {};
                cfg.gridDim = dim3(tiles * splits);
                cfg.blockDim = dim3(GEMM_THREADS);
                cfg.dynamicSmemBytes = smem;
                cfg.stream = s;
                cfg.attrs = &cluster;
                cfg.numAttrs = splits > 1 ? 1 : 0;
                if (sh.kind == STORE)
                    CHECK(cudaLaunchKernelEx(&cfg, gemm_rows, wc, (const u16*)x, out, rows, sh.cols, sh.k, splits));
                if (sh.kind == ADD)
                    CHECK(cudaLaunchKernelEx(&cfg, gemm_rows_add, wc, (const u16*)x, out, rows, sh.cols, sh.k, splits));
                if (sh.kind == SWIGLU)
                    CHECK(cudaLaunchKernelEx(&cfg, gemm_rows_swiglu, wc, (const u16*)x, out, (u16*)nullptr, rows,
                                             sh.cols, sh.k, splits));
            };
            float us[4];
            double err[4];
            for (int si = 0; si < 4; ++si) {
                const u32 splits = 1u << si;
                CHECK(cudaMemcpy(out, hbase.data(), hbase.size() * 4, cudaMemcpyHostToDevice));
                launch(splits, w);
                CHECK(cudaStreamSynchronize(s));
                CHECK(cudaGetLastError());
                CHECK(cudaMemcpy(hout.data(), out, hout.size() * 4, cudaMemcpyDeviceToHost));
                err[si] = 0;
                for (size_t i = 0; i < hout.size(); ++i)
                    err[si] = fmax(err[si], fabs(hout[i] - want[i]) / scale);
                us[si] = time_it([&](int i) { launch(splits, w + (u64)(i % copies) * elems); });
            }
            const u32 host = host_splits(tiles, chunks, prop.multiProcessorCount * ctas_per_sm);
            const float host_us = us[__builtin_ctz(host)];
            printf("%-8s %5u %9.1f %9.1f %9.1f %9.1f %9.1f %9.1f %6u %9.1f %.2e %.2e %.2e %.2e\n", sh.name, rows,
                   bytes / bw * 1e6, cublas_us, us[0], us[1], us[2], us[3], host, host_us, err[0], err[1], err[2],
                   err[3]);
            CHECK(cudaFree(x));
            CHECK(cudaFree(ref));
            CHECK(cudaFree(out));
            CHECK(cudaFree(base));
            CHECK(cudaFree(out_narrow));
        }
        CHECK(cudaFree(w));
    }
    return 0;
}
