// Standalone timing of gemv.cu's decode GEMVs on the Llama-3.1-8B projections (bf16, `rows`
// activation rows), for kernel development on the device: built by launch/device/gemv-bench.sh
// with nvcc against the crate's sources or a variant's `layers.cu` and `gemv.cu`, so variants
// of the kernel are timed alone, apart from a model's step.
//
// Each projection is timed two ways, cycling through enough copies of its weight that none is
// read from L2: launched back to back without programmatic dependence ("alone", as the step
// launches its GEMVs), and as a programmatic dependent after a one-CTA kernel ("chained", less
// that kernel's own chain). gate|up is timed plain and normed (`gate_up_n`, RMSNorm in each
// CTA, as the step runs it). The slices per column group are chosen as the backend chooses them
// (the most whose CTAs fit one wave), or are each of the `slices` argument's (comma-separated)
// in turn. A plain streaming read of the same bytes gives the ceiling. A few output columns are
// checked against an f64 product on the host.
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <vector>

#include "common.cuh"
#include "layers.cu"
#include "gemv.cu"

#include "bench.cuh"

// A stand-in for the small kernel before a projection in a step (an RMSNorm).
__global__ void touch(float* x) {
    let_next_grid_launch();
    wait_for_previous_grid();
    if (threadIdx.x == 0) x[0] = x[0] + 0.f;
}

__global__ void read_all(const uint4* p, u64 n, u32* sink) {
    u32 acc = 0;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const uint4 v = load_streamed(p + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x12345678u) *sink = acc;
}

typedef void (*GemvKernel)(const u16*, const float*, float*, u32, u32, u32, u32);
typedef void (*NormedGemvKernel)(const u16*, const float*, const u16*, float, float*, u32, u32, u32, u32);

// A projection: `kernel`, or `normed` (the other null), which RMS-normalises the rows first as
// the step's gate|up does. The layer's total counts the shapes `in_layer`: gate|up once, normed.
struct Shape {
    const char* name;
    GemvKernel kernel;
    u32 cols, k, mats;
    bool in_layer;
    NormedGemvKernel normed;
};

static float bf16_to_f32(u16 x) {
    u32 b = (u32)x << 16;
    float f;
    memcpy(&f, &b, 4);
    return f;
}

static u16 round_bf16(float f) {
    u32 b;
    memcpy(&b, &f, 4);
    b += 0x7FFFu + ((b >> 16) & 1u);
    return (u16)(b >> 16);
}

int main(int argc, char** argv) {
    const int iters = argc > 1 ? atoi(argv[1]) : 200;
    const u32 rows = argc > 2 ? (u32)atoi(argv[2]) : 1;
    std::vector<u32> slice_choices;  // empty: the backend's choice
    for (const char* c = argc > 3 ? argv[3] : ""; *c; c += strcspn(c, ",") + (c[strcspn(c, ",")] != 0))
        slice_choices.push_back((u32)atoi(c));
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    const Shape shapes[] = {
        {"qkv", gemv, 6144, 4096, 1, true},
        {"o", gemv_add, 4096, 4096, 1, true},
        {"gate_up", gemv_swiglu, 14336, 4096, 2, false},
        {"gate_up_n", nullptr, 14336, 4096, 2, true, gemv_normed_swiglu},
        {"down", gemv_add, 4096, 14336, 1, true},
    };
    const u64 min_bytes = 512ull << 20;  // cycled weights: ten times the L2
    cudaStream_t stream;
    CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    cudaEvent_t t0, t1;
    CHECK(cudaEventCreate(&t0));
    CHECK(cudaEventCreate(&t1));
    u32* sink;
    CHECK(cudaMalloc(&sink, 4));
    double total_us = 0, total_bytes = 0;
    for (const Shape& s : shapes) {
        const u64 elems = (u64)s.cols * s.mats * s.k, bytes = elems * 2;
        const int copies = (int)((min_bytes + bytes - 1) / bytes);
        u16* w;
        CHECK(cudaMalloc(&w, bytes * copies));
        fill_random<<<1024, 256, 0, stream>>>(w, elems * copies, 17u, 0.05f);
        std::vector<float> hx((size_t)rows * s.k);
        for (size_t i = 0; i < hx.size(); ++i) hx[i] = sinf(0.37f * (float)i + 1.f);
        float *x, *out;
        CHECK(cudaMalloc(&x, hx.size() * 4));
        CHECK(cudaMalloc(&out, (size_t)rows * s.cols * 4));
        CHECK(cudaMemcpy(x, hx.data(), hx.size() * 4, cudaMemcpyHostToDevice));
        // A normed product's norm weight, near 1 (else none), and the activation the product
        // sees: rms_norm's rows rounded to bf16 (normed), else x rounded.
        const float eps = 1e-5f;
        std::vector<u16> hgamma(s.k);
        for (u32 e = 0; e < s.k; ++e) hgamma[e] = round_bf16(1.f + 0.1f * sinf(0.11f * (float)e));
        u16* gamma = nullptr;
        if (s.normed) {
            CHECK(cudaMalloc(&gamma, s.k * 2));
            CHECK(cudaMemcpy(gamma, hgamma.data(), s.k * 2, cudaMemcpyHostToDevice));
        }
        std::vector<float> act(hx.size());
        for (u32 m = 0; m < rows; ++m) {
            double sq = 0;
            for (u32 e = 0; e < s.k; ++e) sq += (double)hx[(size_t)m * s.k + e] * hx[(size_t)m * s.k + e];
            const float inv = (float)(1.0 / sqrt(sq / s.k + eps));
            for (u32 e = 0; e < s.k; ++e) {
                const float v = hx[(size_t)m * s.k + e];
                act[(size_t)m * s.k + e] = bf16_to_f32(round_bf16(s.normed ? bf16_to_f32(hgamma[e]) * (v * inv) : v));
            }
        }

        const void* kernel = s.normed ? (const void*)s.normed : (const void*)s.kernel;
        // A normed GEMV stages its normalised rows in dynamic shared memory.
        const int dynamic_smem = s.normed ? (int)(rows * s.k * 2) : 0;
        if (dynamic_smem > 0)
            CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, dynamic_smem));
        int ctas_per_sm = 0;
        CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas_per_sm, kernel, GEMV_WARPS * 32, dynamic_smem));
        const u32 groups = (s.cols + GEMV_COLS - 1) / GEMV_COLS, wave = prop.multiProcessorCount * ctas_per_sm;
        u32 chosen = 1;
        for (u32 c : {(u32)GEMV_WARPS, 4u, 2u})
            if ((groups + GEMV_WARPS / c - 1) / (GEMV_WARPS / c) <= wave) { chosen = c; break; }
        const std::vector<u32> choices = slice_choices.empty() ? std::vector<u32>{chosen} : slice_choices;
        cudaFuncAttributes attr;
        CHECK(cudaFuncGetAttributes(&attr, kernel));

        cudaLaunchAttribute pdl;
        pdl.id = cudaLaunchAttributeProgrammaticStreamSerialization;
        pdl.val.programmaticStreamSerializationAllowed = 1;
        cudaLaunchConfig_t cfg = {};
        cfg.blockDim = dim3(GEMV_WARPS * 32);
        cfg.stream = stream;
        cudaLaunchConfig_t touch_cfg = cfg;
        touch_cfg.gridDim = dim3(1);
        touch_cfg.blockDim = dim3(256);
        touch_cfg.attrs = &pdl;
        touch_cfg.numAttrs = 1;
        cfg.dynamicSmemBytes = dynamic_smem;
        auto time_us = [&](auto&& body) {
            for (int i = 0; i < 20; ++i) body(i);
            CHECK(cudaEventRecord(t0, stream));
            for (int i = 0; i < iters; ++i) body(i);
            CHECK(cudaEventRecord(t1, stream));
            CHECK(cudaEventSynchronize(t1));
            float ms;
            CHECK(cudaEventElapsedTime(&ms, t0, t1));
            return 1000.0 * ms / iters;
        };
        const double touch_us = time_us([&](int) { CHECK(cudaLaunchKernelEx(&touch_cfg, touch, x)); });
        // The ceiling: the same bytes read by a plain grid-stride stream.
        const double read_us = time_us([&](int i) {
            read_all<<<prop.multiProcessorCount * 8, 512, 0, stream>>>(
                reinterpret_cast<const uint4*>(w + (u64)(i % copies) * elems), bytes / 16, sink);
        });

        // The f64 products of copy 0 at the checked (column, row) pairs.
        std::vector<double> want;
        for (u32 c = 0; c < s.cols; c += s.cols / 61) {
            for (u32 m = 0; m < rows; ++m) {
                double acc[2] = {0, 0};
                for (u32 j = 0; j < s.mats; ++j) {
                    std::vector<u16> wrow(s.k);
                    CHECK(cudaMemcpy(wrow.data(), w + ((u64)j * s.cols + c) * s.k, s.k * 2, cudaMemcpyDeviceToHost));
                    for (u32 e = 0; e < s.k; ++e)
                        acc[j] += (double)bf16_to_f32(wrow[e]) * (double)act[(size_t)m * s.k + e];
                }
                want.push_back(s.mats == 2 ? acc[0] / (1.0 + exp(-acc[0])) * acc[1] : acc[0]);
            }
        }

        for (const u32 slices : choices) {
            const u32 grid = (groups + GEMV_WARPS / slices - 1) / (GEMV_WARPS / slices);
            cfg.gridDim = dim3(grid);
            auto launch = [&](int i, bool chained) {
                cfg.attrs = chained ? &pdl : nullptr;
                cfg.numAttrs = chained ? 1 : 0;
                if (chained) CHECK(cudaLaunchKernelEx(&touch_cfg, touch, x));
                const u16* wi = w + (u64)(i % copies) * elems;
                if (s.normed)
                    CHECK(cudaLaunchKernelEx(&cfg, s.normed, wi, (const float*)x, (const u16*)gamma, eps, out, rows,
                                             s.cols, s.k, slices));
                else
                    CHECK(cudaLaunchKernelEx(&cfg, s.kernel, wi, (const float*)x, out, rows, s.cols, s.k, slices));
            };
            const double us = time_us([&](int i) { launch(i, false); });
            const double chained_us = time_us([&](int i) { launch(i, true); }) - touch_us;

            // A fresh product of copy 0 for the check (the add epilogue adds into zeros).
            CHECK(cudaMemsetAsync(out, 0, (size_t)rows * s.cols * 4, stream));
            launch(0, false);
            CHECK(cudaStreamSynchronize(stream));
            std::vector<float> hout((size_t)rows * s.cols);
            CHECK(cudaMemcpy(hout.data(), out, hout.size() * 4, cudaMemcpyDeviceToHost));
            double worst = 0;
            size_t checked = 0;
            for (u32 c = 0; c < s.cols; c += s.cols / 61)
                for (u32 m = 0; m < rows; ++m) {
                    const double v = want[checked++];
                    worst = fmax(worst, fabs(hout[(size_t)m * s.cols + c] - v) / (fabs(v) + 1e-2));
                }
            printf("%-8s cols %5u k %5u  grid %4u slices %u regs %3d ctas/sm %d  alone %7.2f us %5.0f GB/s  chained %7.2f us %5.0f GB/s  read %7.2f us %5.0f GB/s  worst rel err %.2e\n",
                   s.name, s.cols * s.mats, s.k, grid, slices, attr.numRegs, ctas_per_sm, us, bytes / us / 1e3, chained_us,
                   bytes / chained_us / 1e3, read_us, bytes / read_us / 1e3, worst);
            if (slices == choices[0] && s.in_layer) {
                total_us += chained_us;
                total_bytes += bytes;
            }
        }
        CHECK(cudaFree(w));
        CHECK(cudaFree(x));
        CHECK(cudaFree(out));
        CHECK(cudaFree(gamma));
    }
    printf("layer (the first slices), chained: %.2f us for %.1f MB: %.0f GB/s\n", total_us, total_bytes / 1e6, total_bytes / total_us / 1e3);
    return 0;
}
