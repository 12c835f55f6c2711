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
// so every thread reads the old lse before thread 0 rewrites it. Where `rounded` is not null,
// each new acc_o is also written there rounded to the 16-bit type of code `rounded_dtype` (the
// output projection's operand).
extern "C" __global__ void combine_pair(float* __restrict__ acc_o, float* __restrict__ acc_lse,
                                        const float* __restrict__ o, const float* __restrict__ lse, u32 d,
                                        u16* __restrict__ rounded, u32 rounded_dtype) {
    const u32 c = blockIdx.x;
    const float la = acc_lse[c], lb = lse[c];
    const float M = fmaxf(la, lb);
    const float wa = la == NEG_INF ? 0.f : __expf(la - M);
    const float wb = lb == NEG_INF ? 0.f : __expf(lb - M);
    const float den = wa + wb;
    for (u32 i = threadIdx.x; i < d; i += blockDim.x) {
        const u64 at = (u64)c * d + i;
        const float merged = den > 0.f ? (acc_o[at] * wa + o[at] * wb) / den : 0.f;
        acc_o[at] = merged;
        if (rounded) rounded[at] = round_to16(merged, rounded_dtype);
    }
    __syncthreads();
    if (threadIdx.x == 0) acc_lse[c] = den > 0.f ? M + __logf(den) : NEG_INF;
}

// Row rows[i] of src (cols values a row) into row i of dst, in one launch however the rows
// run: states and activations put in the order a collective or a pass reads them.
extern "C" __global__ void gather_rows(const float* __restrict__ src, const u32* __restrict__ rows,
                                       u32 count, u32 cols, float* __restrict__ dst) {
    const u64 n = (u64)count * cols;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const u64 r = i / cols;
        dst[i] = src[(u64)rows[r] * cols + (i - r * cols)];
    }
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

// The all-gather merge as one kernel across GPUs that map each other's memory (canopy-cuda's
// `peer_merge`). `bases[r]` is rank r's merge memory as this GPU addresses it:
//   [flags: ranks x flags_per_rank u32, from byte 0 | slots from byte `slots_at`: 2 parities x
//    ranks packed states [o: cells x d | lse: cells]].
// CTA b of every rank owns the same cells (one warp a cell: b * warps + w, then a grid
// stride), so CTAs meet only their namesakes on other GPUs and never wait on a CTA of their
// own grid. Each call is one epoch, `counters[0]` + 1 (the last CTA to finish stores it; all
// read it before any finishes). A CTA writes its cells into slot `me` of parity (epoch & 1) on
// every rank, itself included, raises its flag there (`me`, b) to the epoch (a release at
// system scope after a system fence), waits until every rank's flag (r, b) here has reached
// the epoch (acquires at system scope), and folds the ranks' states in rank order with
// combine_gathered's arithmetic, so every rank writes the same bits. Two parities suffice: a
// rank starts a call only after its previous call's CTA 0 saw every rank begin that call,
// i.e. finish the one before, the last to read the parity this call writes. The grid and the
// cells may change from call to call. Epochs compare by signed difference, so their wrap at
// 2^32 is harmless. A wait longer than `timeout_ns` (0: none) traps, which fails the context
// instead of spinning forever on a dead peer.
__device__ __forceinline__ u32 load_acquire_sys(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void store_release_sys(u32* p, u32 v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ u64 global_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

extern "C" __global__ void peer_merge(const u64* __restrict__ bases, u32 me, u32 ranks, u32 flags_per_rank,
                                      u64 slots_at, u32* __restrict__ counters, float* __restrict__ o,
                                      float* __restrict__ lse, u32 cells, u32 d, u64 timeout_ns) {
    __shared__ u32 epoch_shared;
    if (threadIdx.x == 0) epoch_shared = *(volatile u32*)&counters[0] + 1;
    __syncthreads();
    const u32 epoch = epoch_shared;
    const u32 warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const u64 n = (u64)cells * d, stride = n + cells;
    const u64 parity_at = (u64)(epoch & 1) * ranks * stride;
    const u32 first = blockIdx.x * warps + warp, step = gridDim.x * warps;

    for (u32 c = first; c < cells; c += step) {
        for (u32 i = lane; i < d; i += 32) {
            const float v = o[(u64)c * d + i];
            for (u32 r = 0; r < ranks; ++r) {
                float* slot = (float*)(bases[r] + slots_at) + parity_at + (u64)me * stride;
                slot[(u64)c * d + i] = v;
            }
        }
        if (lane == 0) {
            const float l = lse[c];
            for (u32 r = 0; r < ranks; ++r) {
                float* slot = (float*)(bases[r] + slots_at) + parity_at + (u64)me * stride;
                slot[n + c] = l;
            }
        }
    }
    __syncthreads();
    if (threadIdx.x < ranks) {
        __threadfence_system();
        store_release_sys((u32*)bases[threadIdx.x] + (u64)me * flags_per_rank + blockIdx.x, epoch);
        const u32* mine = (const u32*)bases[me] + (u64)threadIdx.x * flags_per_rank + blockIdx.x;
        const u64 start = global_ns();
        while ((int)(load_acquire_sys(mine) - epoch) < 0) {
            if (timeout_ns != 0 && global_ns() - start > timeout_ns) __trap();
        }
    }
    __syncthreads();

    const float* slots = (const float*)(bases[me] + slots_at) + parity_at;
    for (u32 c = first; c < cells; c += step) {
        float M = NEG_INF;
        for (u32 r = 0; r < ranks; ++r) M = fmaxf(M, __ldcg(slots + r * stride + n + c));
        for (u32 i = lane; i < d + 1; i += 32) {
            const bool is_o = i < d;
            float den = 0.f, num = 0.f;
            if (M != NEG_INF) {
                for (u32 r = 0; r < ranks; ++r) {
                    const float l = __ldcg(slots + r * stride + n + c);
                    const float w = l == NEG_INF ? 0.f : __expf(l - M);
                    den += w;
                    if (is_o) num = fmaf(__ldcg(slots + r * stride + (u64)c * d + i), w, num);
                }
            }
            if (is_o) o[(u64)c * d + i] = den > 0.f ? num / den : 0.f;
            else lse[c] = den > 0.f ? M + __logf(den) : NEG_INF;
        }
    }
    if (threadIdx.x == 0 && atomicAdd(&counters[1], 1u) == gridDim.x - 1) {
        counters[1] = 0;
        counters[0] = epoch;
    }
}
