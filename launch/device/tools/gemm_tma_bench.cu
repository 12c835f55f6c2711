// A prototype, for kernel development on the device: a product of up to 64 activation rows
// with a bf16 weight whose tiles come in by TMA (2-D bulk tensor copies, 128-byte swizzle) and
// are multiplied by the warpgroup MMA (m64n128k16, both operands in shared memory), timed
// against cuBLAS as canopy calls it. Session 33 found that streaming the weight into registers
// with 16-byte loads tops out under cuBLAS at these row counts; this asks whether the copy
// engine does better. Built by launch/device/gemm-tma-bench.sh with nvcc against the crate's
// `common.cuh` and `mma.cuh` (the descriptor, mbarrier and wgmma helpers of the prefill).
//
// A CTA is four consumer warps (one warpgroup: the 64 rows x 128 weight rows of its tile) and
// one producer warp, whose lane 0 issues each stage's two copies (128 weight rows x 64 k, and
// the 64 activation rows x 64 k) on the stage's `full` barrier and waits on its `empty` one.
// `splits` CTAs split k for one tile: a cluster whose partial tiles meet in distributed shared
// memory (CLUSTER, the default), or CTAs that add their sums into the output with atomics (the
// output is cleared first; the time counts the clearing). Products are checked against
// cuBLAS's.
//
// Each product is timed three ways: alone; after `norm_rows`, the kernel that writes its
// activation in a decode step; and chained, both launched as programmatic dependents, the
// producer asking for its first stages' weight tiles before it waits for the norm. KB boxes of
// 64 k make a stage (KB * 128 bytes of each weight row). NO_X and NO_MMA leave out the
// activation's copies and the MMAs, for diagnosis: the products are then wrong.
#include <cuda.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "common.cuh"
#include "mma.cuh"

#include "bench.cuh"

#define CHECK_OK(x)                                                              \
    do {                                                                         \
        int s_ = (int)(x);                                                       \
        if (s_ != 0) {                                                           \
            fprintf(stderr, "%s:%d status %d: %s\n", __FILE__, __LINE__, s_, #x); \
            exit(1);                                                             \
        }                                                                        \
    } while (0)

#ifndef TMA_STAGES
#define TMA_STAGES 4
#endif
#define BN 128
#define BK 64
// Boxes of BK along k a stage (KB): each weight row then gives KB * 128 consecutive bytes.
#ifndef KB
#define KB 1
#endif
#define W_BOX_BYTES (BN * BK * 2)
#define X_BOX_BYTES (64 * BK * 2)
#define W_TILE_BYTES (KB * W_BOX_BYTES)
#define X_TILE_BYTES (KB * X_BOX_BYTES)
#ifndef NO_X
#define NO_X 0
#endif
#ifndef NO_MMA
#define NO_MMA 0
#endif
#define STAGE_BYTES (W_TILE_BYTES + X_TILE_BYTES)
#define LOAD_BYTES (NO_X ? W_TILE_BYTES : STAGE_BYTES)
#define SMEM_BYTES (TMA_STAGES * STAGE_BYTES + 1024)
#ifndef CLUSTER
#define CLUSTER 1
#endif

__device__ __forceinline__ void tma_load_2d(void* smem, const CUtensorMap* map, int c0, int c1, u64* bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
            (u32)__cvta_generic_to_shared(smem)),
        "l"((u64)map), "r"(c0), "r"(c1), "r"((u32)__cvta_generic_to_shared(bar))
        : "memory");
}

__device__ __forceinline__ u32 cluster_rank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// The float at `p` in the shared memory of the cluster's CTA `rank`.
__device__ __forceinline__ float load_cluster(const float* p, u32 rank) {
    u32 remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"((u32)__cvta_generic_to_shared(p)), "r"(rank));
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
    return v;
}

// Partial tiles (64 rows x BN fp32, rows padded by 4) reuse the stages' memory.
#define RED_LD (BN + 4)

extern "C" __global__ void __launch_bounds__(160, 1)
gemm_tma(const __grid_constant__ CUtensorMap wmap, const __grid_constant__ CUtensorMap xmap, float* __restrict__ out,
         int rows, int cols, int k, int splits, int clustered, int chained) {
#if HAS_WGMMA
    extern __shared__ unsigned char smem_raw[];
    unsigned char* smem = (unsigned char*)(((unsigned long long)smem_raw + 1023) & ~1023ull);
    __shared__ u64 full[TMA_STAGES], empty[TMA_STAGES];
    const int tile = blockIdx.x / splits, split = blockIdx.x % splits;
    const int blocks = (k + BK * KB - 1) / (BK * KB), per = (blocks + splits - 1) / splits;
    const int b0 = min(split * per, blocks), n = min(b0 + per, blocks) - b0;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (threadIdx.x == 0) {
        for (int s = 0; s < TMA_STAGES; ++s) {
            mbar_init(&full[s], 1);
            mbar_init(&empty[s], 4);
        }
        mbar_init_fence();
    }
    __syncthreads();
    if (chained) let_next_grid_launch();
    if (warp == 4) {
        if (lane == 0) {
            // Chained (a programmatic dependent of the kernel that writes the activation): the
            // weight is no kernel's output, so the first stages' weight tiles are asked for
            // before the wait, while that kernel still runs; their activation tiles after it.
            const int early = chained ? min(n, TMA_STAGES) : 0;
            for (int i = 0; i < early; ++i) {
                mbar_expect_bytes(&full[i], LOAD_BYTES);
                for (int b = 0; b < KB; ++b)
                    tma_load_2d(smem + i * STAGE_BYTES + b * W_BOX_BYTES, &wmap, ((b0 + i) * KB + b) * BK, tile * BN,
                                &full[i]);
            }
            if (chained) wait_for_previous_grid();
            for (int i = 0; i < n; ++i) {
                const int s = i % TMA_STAGES;
                unsigned char* st = smem + s * STAGE_BYTES;
                if (i >= early) {
                    // A fresh barrier's previous phase counts as complete: the first round waits not.
                    mbar_wait(&empty[s], ((i / TMA_STAGES) & 1) ^ 1);
                    mbar_expect_bytes(&full[s], LOAD_BYTES);
                    for (int b = 0; b < KB; ++b)
                        tma_load_2d(st + b * W_BOX_BYTES, &wmap, ((b0 + i) * KB + b) * BK, tile * BN, &full[s]);
                }
                for (int b = 0; b < (NO_X ? 0 : KB); ++b)
                    tma_load_2d(st + W_TILE_BYTES + b * X_BOX_BYTES, &xmap, ((b0 + i) * KB + b) * BK, 0, &full[s]);
            }
        }
        // The producer stays for the cluster's barriers.
        if (clustered) {
            cluster_sync();
            cluster_sync();
        }
        return;
    }
    float acc[16][4];
#pragma unroll
    for (int t = 0; t < 16; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[t][e] = 0.f;
    for (int i = 0; i < n; ++i) {
        const int s = i % TMA_STAGES;
        mbar_wait(&full[s], (i / TMA_STAGES) & 1);
        const u16* w = (const u16*)(smem + s * STAGE_BYTES);
        const u16* x = (const u16*)(smem + s * STAGE_BYTES + W_TILE_BYTES);
        wg_fence();
#pragma unroll
        for (int c = 0; c < (NO_MMA ? 0 : 4 * KB); ++c)
            wg_qk128_ss(acc, smem_desc(x + (c / 4) * (X_BOX_BYTES / 2) + (c % 4) * 16, 16, 1024),
                        smem_desc(w + (c / 4) * (W_BOX_BYTES / 2) + (c % 4) * 16, 16, 1024), 1);
        wg_commit();
        wg_wait<0>();
        if (lane == 0) mbar_arrive(&empty[s]);
    }
    // The output may still be read by the kernels before this one.
    if (chained) wait_for_previous_grid();
    const int g = lane / 4, q = lane % 4;
    if (clustered) {
        // The cluster's partial tiles meet in distributed shared memory: each CTA writes its
        // own, then finishes a share of the outputs, adding the ranks' sums in rank order.
        float* red = (float*)smem;
        // Every consumer warp's products are done with the stages before any writes over them.
        asm volatile("bar.sync 1, 128;\n" ::: "memory");
#pragma unroll
        for (int t = 0; t < 16; ++t)
#pragma unroll
            for (int e = 0; e < 4; ++e) red[(warp * 16 + g + (e / 2) * 8) * RED_LD + t * 8 + 2 * q + (e % 2)] = acc[t][e];
        cluster_sync();
        const int rank = (int)cluster_rank(), total = rows * BN, share = (total + splits - 1) / splits;
        const int last = min(total, (rank + 1) * share);
        for (int i = rank * share + (int)threadIdx.x; i < last; i += 128) {
            const int m = i / BN, c = i % BN, col = tile * BN + c;
            float sum = 0.f;
            for (int r = 0; r < splits; ++r) sum += load_cluster(red + m * RED_LD + c, r);
            if (col < cols) out[(u64)m * cols + col] = sum;
        }
        cluster_sync();
        return;
    }
#pragma unroll
    for (int t = 0; t < 16; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int m = warp * 16 + g + (e / 2) * 8, c = tile * BN + t * 8 + 2 * q + (e % 2);
            if (m < rows && c < cols) {
                if (splits > 1) atomicAdd(out + (u64)m * cols + c, acc[t][e]);
                else out[(u64)m * cols + c] = acc[t][e];
            }
        }
#endif
}

// The kernel that stands for what writes a GEMM's activation in a decode step (an RMSNorm):
// each CTA scales one row of `res` (k bf16) by the inverse of its root mean square into `x`. It
// lets the next grid launch at once and waits for the previous one before it writes `x`, which
// that grid (a GEMM) reads.
__global__ void norm_rows(const u16* __restrict__ res, u16* __restrict__ x, int k) {
    let_next_grid_launch();
    __shared__ float part[32];
    const u16* r = res + (u64)blockIdx.x * k;
    float sq = 0.f;
    for (int i = threadIdx.x; i < k; i += blockDim.x) {
        const float v = __uint_as_float((u32)r[i] << 16);
        sq += v * v;
    }
    for (int o = 16; o > 0; o /= 2) sq += __shfl_xor_sync(0xffffffffu, sq, o);
    if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = sq;
    __syncthreads();
    float total = 0.f;
    for (int w = 0; w < (int)blockDim.x / 32; ++w) total += part[w];
    const float scale = rsqrtf(total / k + 1e-5f);
    wait_for_previous_grid();
    for (int i = threadIdx.x; i < k; i += blockDim.x)
        x[(u64)blockIdx.x * k + i] = f32_to_bf16_rn(__uint_as_float((u32)r[i] << 16) * scale);
}

// A 2-D tensor map of a row-major bf16 matrix (rows x k), boxes of box_rows x 64, 128-byte swizzle.
static CUtensorMap tensor_map(const u16* p, int rows, int k, int box_rows) {
    CUtensorMap map;
    const cuuint64_t dims[2] = {(cuuint64_t)k, (cuuint64_t)rows};
    const cuuint64_t strides[1] = {(cuuint64_t)k * 2};
    const cuuint32_t box[2] = {BK, (cuuint32_t)box_rows};
    const cuuint32_t elem[2] = {1, 1};
    CHECK_OK(cuTensorMapEncodeTiled(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, (void*)p, dims, strides, box, elem,
                                    CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                    CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE));
    return map;
}

int main(int argc, char** argv) {
    const int iters = argc > 1 ? atoi(argv[1]) : 100;
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    struct Shape {
        const char* name;
        int n, k;
    };
    const Shape shapes[] = {{"qkv", 6144, 4096}, {"o", 4096, 4096}, {"gate_up", 28672, 4096}, {"down", 4096, 14336}};
    const int row_counts[] = {64};
    cudaStream_t s;
    CHECK(cudaStreamCreate(&s));
    cublasHandle_t blas;
    CHECK_OK(cublasCreate(&blas));
    CHECK_OK(cublasSetStream(blas, s));
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
    const size_t copy_bytes = 1ull << 30;
    void *src, *dst;
    CHECK(cudaMalloc(&src, copy_bytes));
    CHECK(cudaMalloc(&dst, copy_bytes));
    const float copy_us = time_it([&](int) { CHECK(cudaMemcpyAsync(dst, src, copy_bytes, cudaMemcpyDeviceToDevice, s)); });
    const double bw = 2.0 * copy_bytes / (copy_us * 1e-6);
    CHECK(cudaFree(src));
    CHECK(cudaFree(dst));
    CHECK(cudaFuncSetAttribute(gemm_tma, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES));
    int ctas_per_sm = 0;
    CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas_per_sm, gemm_tma, 160, SMEM_BYTES));
    cudaFuncAttributes attr;
    CHECK(cudaFuncGetAttributes(&attr, gemm_tma));
    printf("%s, copy bandwidth %.0f GB/s; gemm_tma: %d stages of %d boxes, %d CTAs/SM, %d registers, %zu local bytes, splits %s\n",
           prop.name, bw / 1e9, TMA_STAGES, KB, ctas_per_sm, attr.numRegs, attr.localSizeBytes,
           CLUSTER ? "in clusters" : "by atomics");
    printf("Each column: the product alone / after the norm kernel (pair minus the norm alone) / the same pair "
           "chained (both programmatic dependents, the weight asked for before the wait), us\n");
    const u64 min_bytes = 512ull << 20;
    for (const Shape& sh : shapes) {
        const u64 elems = (u64)sh.n * sh.k, bytes = elems * 2;
        const int copies = (int)((min_bytes + bytes - 1) / bytes);
        u16* w;
        CHECK(cudaMalloc(&w, bytes * copies));
        fill_random<<<1024, 256, 0, s>>>(w, elems * copies, 17u, 0.05f);
        std::vector<CUtensorMap> wmaps;
        for (int c = 0; c < copies; ++c) wmaps.push_back(tensor_map(w + (u64)c * elems, sh.n, sh.k, BN));
        for (int rows : row_counts) {
            u16 *x, *res;
            float *ref, *out;
            CHECK(cudaMalloc(&x, (size_t)64 * sh.k * 2));
            CHECK(cudaMalloc(&res, (size_t)64 * sh.k * 2));
            CHECK(cudaMemset(x, 0, (size_t)64 * sh.k * 2));
            CHECK(cudaMalloc(&ref, (size_t)rows * sh.n * 4));
            CHECK(cudaMalloc(&out, (size_t)rows * sh.n * 4));
            fill_random<<<256, 256, 0, s>>>(res, (u64)rows * sh.k, 7u + rows, 2.f);
            norm_rows<<<rows, 256, 0, s>>>(res, x, sh.k);
            const CUtensorMap xmap = tensor_map(x, 64, sh.k, 64);
            const float alpha = 1.f, zero = 0.f;
            auto cublas = [&](int copy) {
                CHECK_OK(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, sh.n, rows, sh.k, &alpha,
                                      w + (u64)copy * elems, CUDA_R_16BF, sh.k, x, CUDA_R_16BF, sh.k, &zero, out,
                                      CUDA_R_32F, sh.n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
            };
            cudaLaunchAttribute pdl;
            pdl.id = cudaLaunchAttributeProgrammaticStreamSerialization;
            pdl.val.programmaticStreamSerializationAllowed = 1;
            auto norm = [&](int chained) {
                cudaLaunchConfig_t cfg = {};
                cfg.gridDim = dim3(rows);
                cfg.blockDim = dim3(256);
                cfg.stream = s;
                cfg.attrs = &pdl;
                cfg.numAttrs = chained;
                CHECK(cudaLaunchKernelEx(&cfg, norm_rows, (const u16*)res, x, sh.k));
            };
            CHECK_OK(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, sh.n, rows, sh.k, &alpha, w, CUDA_R_16BF, sh.k, x,
                                  CUDA_R_16BF, sh.k, &zero, ref, CUDA_R_32F, sh.n, CUBLAS_COMPUTE_32F,
                                  CUBLAS_GEMM_DEFAULT));
            const float norm_us = time_it([&](int) { norm(0); });
            const float cublas_us = time_it([&](int i) { cublas(i % copies); });
            const float cublas_pair = time_it([&](int i) {
                norm(0);
                cublas(i % copies);
            });
            std::vector<float> want((size_t)rows * sh.n), got(want.size());
            CHECK(cudaMemcpy(want.data(), ref, want.size() * 4, cudaMemcpyDeviceToHost));
            double scale = 0;
            for (float v : want) scale = std::max(scale, (double)fabsf(v));
            const int tiles = (sh.n + BN - 1) / BN;
            // Splits of a cluster (CLUSTER set) or added with atomics after a clearing.
            auto launch = [&](int splits, int copy, int chained) {
                const int clustered = CLUSTER && splits > 1;
                if (splits > 1 && !clustered) CHECK(cudaMemsetAsync(out, 0, (size_t)rows * sh.n * 4, s));
                cudaLaunchAttribute attrs[2];
                int count = 0;
                if (clustered) {
                    attrs[count].id = cudaLaunchAttributeClusterDimension;
                    attrs[count].val.clusterDim.x = splits;
                    attrs[count].val.clusterDim.y = 1;
                    attrs[count].val.clusterDim.z = 1;
                    ++count;
                }
                if (chained) attrs[count++] = pdl;
                cudaLaunchConfig_t cfg = {};
                cfg.gridDim = dim3(tiles * splits);
                cfg.blockDim = dim3(160);
                cfg.dynamicSmemBytes = SMEM_BYTES;
                cfg.stream = s;
                cfg.attrs = attrs;
                cfg.numAttrs = count;
                CHECK(cudaLaunchKernelEx(&cfg, gemm_tma, wmaps[copy], xmap, out, rows, sh.n, sh.k, splits, clustered,
                                         chained));
            };
            printf("%-8s rows %d: floor %.1f, norm alone %.1f, cuBLAS %.1f / %.1f\n", sh.name, rows,
                   bytes / bw * 1e6, norm_us, cublas_us, cublas_pair - norm_us);
            for (int si = 0; si < 4; ++si) {
                const int splits = 1 << si;
                double err[2];
                for (int chained = 0; chained < 2; ++chained) {
                    CHECK(cudaMemset(out, 0xff, (size_t)rows * sh.n * 4));
                    norm(chained);
                    launch(splits, 0, chained);
                    CHECK(cudaStreamSynchronize(s));
                    CHECK(cudaGetLastError());
                    CHECK(cudaMemcpy(got.data(), out, got.size() * 4, cudaMemcpyDeviceToHost));
                    err[chained] = 0;
                    for (size_t i = 0; i < got.size(); ++i) {
                        const double e = std::isfinite(got[i]) ? fabs(got[i] - want[i]) / scale : INFINITY;
                        err[chained] = std::max(err[chained], e);
                    }
                }
                const float alone = time_it([&](int i) { launch(splits, i % copies, 0); });
                const float pair = time_it([&](int i) {
                    norm(0);
                    launch(splits, i % copies, 0);
                });
                const float chain = time_it([&](int i) {
                    norm(1);
                    launch(splits, i % copies, 1);
                });
                printf("  split %d: %.1f / %.1f / %.1f   max rel err %.2e, chained %.2e\n", splits, alone,
                       pair - norm_us, chain - norm_us, err[0], err[1]);
            }
            CHECK(cudaFree(x));
            CHECK(cudaFree(res));
            CHECK(cudaFree(ref));
            CHECK(cudaFree(out));
        }
        CHECK(cudaFree(w));
    }
    return 0;
}
