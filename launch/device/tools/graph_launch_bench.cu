// What a CUDA graph's launch costs the host, and how long the GPU waits for its first kernel,
// for graphs shaped like a decode pass: LAYERS layers of KERNELS kernels, each kernel a grid
// of one CTA an SM spinning for SPIN_NS, launched plainly or as programmatic dependents (PDL),
// with ALLOCS stream-ordered allocations a layer made and freed inside the recording (graph
// memory nodes) or none, and the pass recorded as one graph or cut into PARTS graphs launched
// back to back.
//
// For each form: the host's time in the launch calls, and the time from an event recorded just
// before the first launch to the first kernel's start (the GPU's wait), over ITERS replays.
// The stamps are %globaltimer; the event's time is placed on that clock by a stamping kernel
// launched on its own just before.
#include <cuda.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "check.cuh"

__device__ __forceinline__ unsigned long long now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Kernel `i` of the pass: stamps its start (CTA 0), waits for the kernel before it where it is
// a programmatic dependent, spins, and touches `scratch` so a memory node has a reader.
__global__ void spin(unsigned long long* stamps, int i, unsigned spin_ns, float* scratch, int pdl) {
    if (pdl) asm volatile("griddepcontrol.wait;" ::: "memory");
    if (blockIdx.x == 0 && threadIdx.x == 0) stamps[i] = now_ns();
    const unsigned long long until = now_ns() + spin_ns;
    while (now_ns() < until) {
    }
    if (scratch && threadIdx.x == 0) scratch[blockIdx.x] = (float)i;
    if (pdl) asm volatile("griddepcontrol.launch_dependents;");
}

__global__ void stamp(unsigned long long* at) { *at = now_ns(); }

struct Form {
    const char* name;
    int pdl, allocs, parts;
};

int main(int argc, char** argv) {
    const int layers = 32, kernels = argc > 1 ? atoi(argv[1]) : 13, iters = argc > 2 ? atoi(argv[2]) : 30;
    const unsigned spin_ns = 10000;
    int sms = 0;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    cudaStream_t s;
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    const int total = layers * kernels;
    unsigned long long *stamps, *at;
    CHECK(cudaMalloc(&stamps, sizeof(unsigned long long) * total));
    CHECK(cudaMalloc(&at, sizeof(unsigned long long)));
    const Form forms[] = {
        {"plain", 0, 0, 1},          {"pdl", 1, 0, 1},          {"pdl+alloc5", 1, 5, 1},
        {"plain+alloc5", 0, 5, 1},   {"pdl, 4 parts", 1, 0, 4}, {"pdl, 8 parts", 1, 0, 8},
        {"pdl, 32 parts", 1, 0, 32}, {"pdl+alloc5, 8 parts", 1, 5, 8},
    };
    printf("%d layers x %d kernels = %d kernels of %d CTAs spinning %u ns; %d replays each\n", layers, kernels,
           total, sms, spin_ns, iters);
    printf("%-22s %8s %12s %12s %12s %12s\n", "form", "nodes", "launch us", "first wait", "span us",
           "end-to-end");
    for (const Form& f : forms) {
        std::vector<cudaGraphExec_t> execs;
        size_t nodes = 0;
        const int per_part = layers / f.parts;
        for (int p = 0; p < f.parts; ++p) {
            CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
            for (int l = p * per_part; l < (p + 1) * per_part; ++l) {
                std::vector<float*> bufs(f.allocs);
                for (auto& b : bufs) CHECK(cudaMallocAsync(&b, 4 << 20, s));
                for (int k = 0; k < kernels; ++k) {
                    const int i = l * kernels + k;
                    float* scratch = f.allocs ? bufs[k % f.allocs] : nullptr;
                    cudaLaunchConfig_t cfg = {};
                    cfg.gridDim = dim3(sms);
                    cfg.blockDim = dim3(128);
                    cfg.stream = s;
                    cudaLaunchAttribute attr;
                    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
                    attr.val.programmaticStreamSerializationAllowed = 1;
                    cfg.attrs = &attr;
                    cfg.numAttrs = f.pdl ? 1 : 0;
                    CHECK(cudaLaunchKernelEx(&cfg, spin, stamps, i, spin_ns, scratch, f.pdl));
                }
                for (auto b : bufs) CHECK(cudaFreeAsync(b, s));
            }
            cudaGraph_t g;
            CHECK(cudaStreamEndCapture(s, &g));
            size_t n = 0;
            CHECK(cudaGraphGetNodes(g, nullptr, &n));
            nodes += n;
            cudaGraphExec_t e;
            CHECK(cudaGraphInstantiate(&e, g, 0));
            CHECK(cudaGraphUpload(e, s));
            CHECK(cudaGraphDestroy(g));
            execs.push_back(e);
        }
        CHECK(cudaStreamSynchronize(s));
        std::vector<double> launch_us, wait_us, span_us, e2e_us;
        for (int it = 0; it < iters + 3; ++it) {
            stamp<<<1, 1, 0, s>>>(at);
            CHECK(cudaStreamSynchronize(s));
            const auto t0 = std::chrono::steady_clock::now();
            stamp<<<1, 1, 0, s>>>(at);
            const auto t1 = std::chrono::steady_clock::now();
            for (auto e : execs) CHECK(cudaGraphLaunch(e, s));
            const auto t2 = std::chrono::steady_clock::now();
            CHECK(cudaStreamSynchronize(s));
            const auto t3 = std::chrono::steady_clock::now();
            std::vector<unsigned long long> st(total);
            unsigned long long a = 0;
            CHECK(cudaMemcpy(st.data(), stamps, sizeof(unsigned long long) * total, cudaMemcpyDeviceToHost));
            CHECK(cudaMemcpy(&a, at, sizeof(a), cudaMemcpyDeviceToHost));
            if (it < 3) continue;
            launch_us.push_back(std::chrono::duration<double, std::micro>(t2 - t1).count());
            wait_us.push_back((st[0] - a) / 1e3);
            span_us.push_back((st[total - 1] - st[0]) / 1e3 + spin_ns / 1e3);
            e2e_us.push_back(std::chrono::duration<double, std::micro>(t3 - t0).count());
        }
        auto med = [](std::vector<double> v) {
            std::sort(v.begin(), v.end());
            return v[v.size() / 2];
        };
        printf("%-22s %8zu %12.1f %12.1f %12.1f %12.1f\n", f.name, nodes, med(launch_us), med(wait_us),
               med(span_us), med(e2e_us));
        for (auto e : execs) CHECK(cudaGraphExecDestroy(e));
    }
    printf("ideal span: %.1f us\n", total * spin_ns / 1e3);
    return 0;
}
