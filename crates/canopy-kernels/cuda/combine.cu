// The cross-rank Tree Attention merge on the device, between NCCL collectives.
//
// States are `cells` = queries x heads of (o[d] normalised, natural-log lse). With M the
// all-reduced max of lse, each rank contributes numerator o * exp(lse - M) and denominator
// exp(lse - M); after the SUM the result is (num / den, M + ln den). Empty partials (lse = -inf)
// weigh 0, and a cell empty on every rank stays empty (o = 0, lse = -inf): never NaN.
//
// Packed layout for the SUM: [num: cells x d | den: cells], so allreduce2 is one collective.

extern "C" __global__ void combine_weights(const float* __restrict__ o, const float* __restrict__ lse,
                                           const float* __restrict__ max_lse, float* __restrict__ packed,
                                           u32 cells, u32 d) {
    const u64 n = (u64)cells * d;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n + cells; i += (u64)gridDim.x * blockDim.x) {
        const u32 c = i < n ? (u32)(i / d) : (u32)(i - n);
        const float w = lse[c] == NEG_INF ? 0.f : __expf(lse[c] - max_lse[c]);
        packed[i] = i < n ? o[i] * w : w;
    }
}

extern "C" __global__ void combine_finish(const float* __restrict__ packed, const float* __restrict__ max_lse,
                                          float* __restrict__ o, float* __restrict__ lse, u32 cells, u32 d) {
    const u64 n = (u64)cells * d;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n + cells; i += (u64)gridDim.x * blockDim.x) {
        if (i < n) {
            const float den = packed[n + i / d];
            o[i] = den > 0.f ? packed[i] / den : 0.f;
        } else {
            const u32 c = (u32)(i - n);
            const float den = packed[n + c];
            lse[c] = den > 0.f ? max_lse[c] + __logf(den) : NEG_INF;
        }
    }
}

// All-gather form: `gathered` holds every rank's [o: cells x d | lse: cells], rank by rank;
// each thread folds one element over the ranks in rank order (deterministic).
extern "C" __global__ void combine_gathered(const float* __restrict__ gathered, u32 ranks,
                                            float* __restrict__ o, float* __restrict__ lse, u32 cells, u32 d) {
    const u64 n = (u64)cells * d, stride = n + cells;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n + cells; i += (u64)gridDim.x * blockDim.x) {
        const u32 c = i < n ? (u32)(i / d) : (u32)(i - n);
        float M = NEG_INF;
        for (u32 r = 0; r < ranks; ++r) M = fmaxf(M, gathered[r * stride + n + c]);
        float den = 0.f, num = 0.f;
        if (M != NEG_INF) {
            for (u32 r = 0; r < ranks; ++r) {
                const float l = gathered[r * stride + n + c];
                const float w = l == NEG_INF ? 0.f : __expf(l - M);
                den += w;
                if (i < n) num = fmaf(gathered[r * stride + i], w, num);
            }
        }
        if (i < n) o[i] = den > 0.f ? num / den : 0.f;
        else lse[c] = den > 0.f ? M + __logf(den) : NEG_INF;
    }
}

// The ring's fold: (acc_o, acc_lse) <- merge((acc_o, acc_lse), (o, lse)). One block per cell,
// so every thread reads the old lse before thread 0 rewrites it.
extern "C" __global__ void combine_pair(float* __restrict__ acc_o, float* __restrict__ acc_lse,
                                        const float* __restrict__ o, const float* __restrict__ lse, u32 d) {
    const u32 c = blockIdx.x;
    const float la = acc_lse[c], lb = lse[c];
    const float M = fmaxf(la, lb);
    const float wa = la == NEG_INF ? 0.f : __expf(la - M);
    const float wb = lb == NEG_INF ? 0.f : __expf(lb - M);
    const float den = wa + wb;
    for (u32 i = threadIdx.x; i < d; i += blockDim.x) {
        const u64 at = (u64)c * d + i;
        acc_o[at] = den > 0.f ? (acc_o[at] * wa + o[at] * wb) / den : 0.f;
    }
    __syncthreads();
    if (threadIdx.x == 0) acc_lse[c] = den > 0.f ? M + __logf(den) : NEG_INF;
}

// The in-device transport's all-reduce (canopy-cuda's `device_world`): `slots` holds `count`
// ranks' copies of `n` values, rank by rank; out[i] = the fold of slot 0, 1, ... at i, in rank
// order, with `op` REDUCE_SUM or REDUCE_MAX (defined by the kernel registry). Every
// rank folds the same bytes in the same order with one add or fmaxf per step (nothing to
// contract into an FMA), so all ranks get the same bits, and the same bits as the host
// transports' rank-order fold.
#ifndef REDUCE_SUM
#error "REDUCE_SUM must be defined by the kernel registry"
#endif
#ifndef REDUCE_MAX
#error "REDUCE_MAX must be defined by the kernel registry"
#endif
extern "C" __global__ void reduce_slots(const float* __restrict__ slots, u32 count, u64 n, u32 op,
                                        float* __restrict__ out) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        float acc = slots[i];
        for (u32 r = 1; r < count; ++r) {
            const float x = slots[(u64)r * n + i];
            acc = op == REDUCE_MAX ? fmaxf(acc, x) : acc + x;
        }
        out[i] = acc;
    }
}
