// The dense layers' GEMMs at serving's row counts, as canopy runs them (cublasGemmEx, default
// algorithm: bf16 weight transposed, bf16 activation, fp32 output, residual accumulated for o
// and down) beside every cuBLASLt algorithm its heuristic offers for the same product, each
// timed alone over weight copies that do not fit L2. Prints, per (projection, rows), the
// default's µs, the heuristic's first choice, the fastest of the offered ones, and the weight
// floor (bytes / the copy bandwidth measured here); with SEARCH set, every configuration of
// every listed algorithm too (`search`). Built on the device by lt-bench.sh.
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <functional>
#include <vector>

#define CHECK_CUDA(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
    std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); std::exit(1); } } while (0)
#define CHECK_BLAS(x) do { int status_ = (int)(x); if (status_ != 0) { \
    std::fprintf(stderr, "%s:%d cublas status %d\n", __FILE__, __LINE__, status_); std::exit(1); } } while (0)

struct Shape { const char* name; int n, k; bool accumulate, narrow; };

static float time_it(cudaStream_t s, int iters, const std::function<void(int)>& f) {
    cudaEvent_t a, b;
    CHECK_CUDA(cudaEventCreate(&a));
    CHECK_CUDA(cudaEventCreate(&b));
    for (int i = 0; i < 3; ++i) f(i);
    CHECK_CUDA(cudaEventRecord(a, s));
    for (int i = 0; i < iters; ++i) f(i);
    CHECK_CUDA(cudaEventRecord(b, s));
    CHECK_CUDA(cudaEventSynchronize(b));
    float ms = 0.f;
    CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    return ms * 1000.f / iters;
}

__global__ void fill(__nv_bfloat16* p, size_t n, unsigned seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        unsigned h = (unsigned)(i * 2654435761u) ^ seed;
        h ^= h >> 13; h *= 0x5bd1e995u; h ^= h >> 15;
        p[i] = __float2bfloat16(((h & 0xffff) / 65536.f - 0.5f) * 0.1f);
    }
}

// SEARCH=1: every algorithm id cuBLASLt lists for the product, with each tile, stage count,
// split-K and reduction scheme its capabilities allow and cublasLtMatmulAlgoCheck accepts.
// A quick pass of 3 launches ranks them; the 12 fastest are timed again over `iters`, and the
// five fastest printed beside the default's time.
using Run = std::function<void(int, const cublasLtMatmulAlgo_t*)>;
static void search(cublasLtHandle_t lt, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t la,
                   cublasLtMatrixLayout_t lb, cublasLtMatrixLayout_t lc, const char* name, int rows, float def,
                   int iters, cudaStream_t s, const Run& run, cudaDataType c_type, size_t ws_bytes) {
    struct Found { float us; int id, tile, stages, split; unsigned scheme; cublasLtMatmulAlgo_t algo; };
    std::vector<Found> all;
    int ids[256], n_ids = 0;
    CHECK_BLAS(cublasLtMatmulAlgoGetIds(lt, CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_16BF, CUDA_R_16BF, c_type, c_type,
                                        256, ids, &n_ids));
    // The listed values of one capability (none: one undefined value, the algorithm's choice).
    auto cap_list = [](const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoCapAttributes_t attr, int undefined) {
        size_t got = 0;
        cublasLtMatmulAlgoCapGetAttribute(&algo, attr, nullptr, 0, &got);
        std::vector<int> v(got / sizeof(int));
        if (!v.empty()) cublasLtMatmulAlgoCapGetAttribute(&algo, attr, v.data(), v.size() * sizeof(int), &got);
        if (v.empty()) v.push_back(undefined);
        return v;
    };
    const int splits[] = {1, 2, 3, 4, 6, 8, 16};
    for (int ii = 0; ii < n_ids; ++ii) {
        cublasLtMatmulAlgo_t algo;
        if (cublasLtMatmulAlgoInit(lt, CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_16BF, CUDA_R_16BF, c_type, c_type, ids[ii],
                                   &algo) != CUBLAS_STATUS_SUCCESS)
            continue;
        const auto tiles = cap_list(algo, CUBLASLT_ALGO_CAP_TILE_IDS, CUBLASLT_MATMUL_TILE_UNDEFINED);
        const auto stages = cap_list(algo, CUBLASLT_ALGO_CAP_STAGES_IDS, CUBLASLT_MATMUL_STAGES_UNDEFINED);
        size_t got = 0;
        int split_ok = 0;
        cublasLtMatmulAlgoCapGetAttribute(&algo, CUBLASLT_ALGO_CAP_SPLITK_SUPPORT, &split_ok, sizeof(split_ok), &got);
        unsigned scheme_mask = 0;
        cublasLtMatmulAlgoCapGetAttribute(&algo, CUBLASLT_ALGO_CAP_REDUCTION_SCHEME_MASK, &scheme_mask,
                                          sizeof(scheme_mask), &got);
        for (int tile : tiles)
            for (int stage : stages)
                for (int split : splits) {
                    if (split > 1 && !split_ok) continue;
                    // Scheme 0 (none) without split-K; 1, 2 and 4 (in place, compute type, output
                    // type) with it, where the mask allows.
                    for (unsigned scheme = 0; scheme <= 4; scheme = scheme ? scheme * 2 : 1) {
                        if (split == 1 && scheme) break;
                        if (split > 1 && !(scheme & scheme_mask)) continue;
                        cublasLtMatmulAlgo_t a = algo;
                        cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof(int));
                        cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stage, sizeof(int));
                        cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &split, sizeof(int));
                        cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &scheme,
                                                             sizeof(scheme));
                        cublasLtMatmulHeuristicResult_t r{};
                        if (cublasLtMatmulAlgoCheck(lt, desc, la, lb, lc, lc, &a, &r) != CUBLAS_STATUS_SUCCESS) continue;
                        if (r.workspaceSize > ws_bytes) continue;
                        const float us = time_it(s, 3, [&](int i) { run(i, &a); });
                        all.push_back({us, ids[ii], tile, stage, split, scheme, a});
                    }
                }
    }
    const size_t searched = all.size();
    std::sort(all.begin(), all.end(), [](const Found& a, const Found& b) { return a.us < b.us; });
    if (all.size() > 12) all.resize(12);
    for (Found& f : all) f.us = time_it(s, iters, [&](int i) { run(i, &f.algo); });
    std::sort(all.begin(), all.end(), [](const Found& a, const Found& b) { return a.us < b.us; });
    std::printf("search %s rows %d: default %.1f us; fastest of %zu configurations:\n", name, rows, def, searched);
    for (size_t i = 0; i < all.size() && i < 5; ++i)
        std::printf("  %.1f us: algo %d tile %d stages %d split %d scheme %u\n", all[i].us, all[i].id, all[i].tile,
                    all[i].stages, all[i].split, all[i].scheme);
}

int main(int argc, char** argv) {
    const int iters = argc > 1 ? std::atoi(argv[1]) : 50;
    // Row counts: argv[2], comma-separated, else serving's.
    std::vector<int> row_counts = {16, 32, 64, 128, 256};
    if (argc > 2) {
        row_counts.clear();
        for (const char* p = argv[2]; *p;) {
            row_counts.push_back(std::atoi(p));
            while (*p && *p != ',') ++p;
            if (*p) ++p;
        }
    }
    // gate|up's product is stored in bf16, as canopy stores a 16-bit weight's. `o-store` and
    // `down-store` are o and down storing their product (beta 0), where the residual would be
    // added by the kernel after them.
    const Shape shapes[] = {{"qkv", 6144, 4096, false, false},     {"o", 4096, 4096, true, false},
                            {"o-store", 4096, 4096, false, false}, {"gate_up", 28672, 4096, false, true},
                            {"down", 4096, 14336, true, false},   {"down-store", 4096, 14336, false, false}};
    cudaStream_t s;
    CHECK_CUDA(cudaStreamCreate(&s));
    cublasHandle_t blas;
    CHECK_BLAS(cublasCreate(&blas));
    CHECK_BLAS(cublasSetStream(blas, s));
    cublasLtHandle_t lt;
    CHECK_BLAS(cublasLtCreate(&lt));
    const size_t ws_bytes = 32u << 20;
    void* ws;
    CHECK_CUDA(cudaMalloc(&ws, ws_bytes));

    // Copy bandwidth: a 1 GB device-to-device copy.
    const size_t copy_bytes = 1u << 30;
    void *src, *dst;
    CHECK_CUDA(cudaMalloc(&src, copy_bytes));
    CHECK_CUDA(cudaMalloc(&dst, copy_bytes));
    const float copy_us = time_it(s, 10, [&](int) { CHECK_CUDA(cudaMemcpyAsync(dst, src, copy_bytes, cudaMemcpyDeviceToDevice, s)); });
    const double bw = 2.0 * copy_bytes / (copy_us * 1e-6);  // read + write, bytes/s
    CHECK_CUDA(cudaFree(src));
    CHECK_CUDA(cudaFree(dst));
    std::printf("copy bandwidth %.0f GB/s\n", bw / 1e9);
    std::printf("%-8s %5s %10s %10s %10s %10s %6s %12s %s\n", "proj", "rows", "floor us", "default", "lt first",
                "lt best", "algos", "best/default", "TFLOP/s default, best");

    for (const Shape& sh : shapes) {
        const size_t w_elems = (size_t)sh.n * sh.k;
        const int copies = (int)std::max<size_t>(2, (200u << 20) / (w_elems * 2) + 1);
        std::vector<__nv_bfloat16*> w(copies);
        for (auto& p : w) {
            CHECK_CUDA(cudaMalloc(&p, w_elems * 2));
            fill<<<1024, 256, 0, s>>>(p, w_elems, (unsigned)(size_t)p);
        }
        for (int rows : row_counts) {
            __nv_bfloat16* x;
            float* c;
            CHECK_CUDA(cudaMalloc(&x, (size_t)rows * sh.k * 2));
            CHECK_CUDA(cudaMalloc(&c, (size_t)rows * sh.n * 4));
            const cudaDataType c_type = sh.narrow ? CUDA_R_16BF : CUDA_R_32F;
            fill<<<256, 256, 0, s>>>(x, (size_t)rows * sh.k, 7);
            CHECK_CUDA(cudaMemsetAsync(c, 0, (size_t)rows * sh.n * 4, s));
            const float alpha = 1.f, beta = sh.accumulate ? 1.f : 0.f;
            const float def = time_it(s, iters, [&](int i) {
                CHECK_BLAS(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, sh.n, rows, sh.k, &alpha, w[i % copies],
                                        CUDA_R_16BF, sh.k, x, CUDA_R_16BF, sh.k, &beta, c, c_type, sh.n,
                                        CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
            });
            cublasLtMatmulDesc_t desc;
            CHECK_BLAS(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
            const cublasOperation_t t = CUBLAS_OP_T;
            CHECK_BLAS(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t)));
            cublasLtMatrixLayout_t la, lb, lc;
            CHECK_BLAS(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, sh.k, sh.n, sh.k));
            CHECK_BLAS(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, sh.k, rows, sh.k));
            CHECK_BLAS(cublasLtMatrixLayoutCreate(&lc, c_type, sh.n, rows, sh.n));
            cublasLtMatmulPreference_t pref;
            CHECK_BLAS(cublasLtMatmulPreferenceCreate(&pref));
            CHECK_BLAS(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                                            sizeof(ws_bytes)));
            cublasLtMatmulHeuristicResult_t found[32];
            int count = 0;
            CHECK_BLAS(cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, lc, lc, pref, 32, found, &count));
            float first = 0.f, best = 1e30f;
            for (int a = 0; a < count; ++a) {
                const float us = time_it(s, iters, [&](int i) {
                    CHECK_BLAS(cublasLtMatmul(lt, desc, &alpha, w[i % copies], la, x, lb, &beta, c, lc, c, lc,
                                              &found[a].algo, ws, ws_bytes, s));
                });
                if (a == 0) first = us;
                if (us < best) best = us;
            }
            if (std::getenv("SEARCH")) search(lt, desc, la, lb, lc, sh.name, rows, def, iters, s, [&](int i, const cublasLtMatmulAlgo_t* a) {
                CHECK_BLAS(cublasLtMatmul(lt, desc, &alpha, w[i % copies], la, x, lb, &beta, c, lc, c, lc, a, ws,
                                          ws_bytes, s));
            }, c_type, ws_bytes);
            const double floor_us = (w_elems * 2.0) / bw * 1e6;
            const double flop = 2.0 * rows * sh.n * (double)sh.k;
            std::printf("%-8s %5d %10.1f %10.1f %10.1f %10.1f %6d %12.3f %.0f, %.0f\n", sh.name, rows, floor_us, def,
                        first, best, count, best / def, flop / def * 1e-6, flop / best * 1e-6);
            cublasLtMatmulPreferenceDestroy(pref);
            cublasLtMatrixLayoutDestroy(la);
            cublasLtMatrixLayoutDestroy(lb);
            cublasLtMatrixLayoutDestroy(lc);
            cublasLtMatmulDescDestroy(desc);
            CHECK_CUDA(cudaFree(x));
            CHECK_CUDA(cudaFree(c));
        }
        for (auto p : w) CHECK_CUDA(cudaFree(p));
    }
    return 0;
}
