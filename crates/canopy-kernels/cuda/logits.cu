// The ops on a pass's logits, compiled after layers.cu as one program (the kernel registry's
// Layers variant): each row narrowed to its likeliest tokens, its log-normaliser, its softmax
// total at a temperature, and single logits read and written (walks.cu walks the rest of a draw
// past a row's likeliest tokens).

#ifndef TOP_ITEMS
#error "TOP_ITEMS must be defined by the kernel registry"
#endif
#define TOP_SEGMENT (LAYER_THREADS * TOP_ITEMS)

// A token's place in canopy_core::logits' order as one 64-bit key, the larger first: the
// logit's bits folded so that unsigned order is f32::total_cmp's, above the token's
// complement, so that among equal logits the lower token wins. Keys are distinct; 0 is below
// every real one and pads a segment.
__device__ __forceinline__ u64 logit_key(float x, u32 token) {
    u32 b = __float_as_uint(x);
    b = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ((u64)b << 32) | (u64)(0xFFFFFFFFu - token);
}

__device__ __forceinline__ float key_logit(u64 key) {
    const u32 b = (u32)(key >> 32);
    return __uint_as_float((b & 0x80000000u) ? (b & 0x7FFFFFFFu) : ~b);
}

__device__ __forceinline__ u32 key_token(u64 key) { return 0xFFFFFFFFu - (u32)key; }

// One pass of narrowing each row to its k most likely tokens: CTA (segment, row) takes
// entries [segment · TOP_SEGMENT, +TOP_SEGMENT) of the row's n (logits when `from_logits`,
// else the keys of an earlier pass) and finds their k largest keys: for k up to
// TOP_ROUNDS_MAX in k rounds, each the block's largest key still held (top_rounds), and for a
// larger k by radix selection (top_select). A pass of several segments writes each segment's
// keys, in no order, for the next pass (`keys_out`, rows × segments × k); a pass of one
// segment writes the row's k logits, most likely first, then their tokens as f32 bit patterns
// (`out`, rows × 2k).
#ifndef TOP_ROUNDS_MAX
#error "TOP_ROUNDS_MAX must be defined by the kernel registry"
#endif

// Key `i` of a pass's k keys: to the next pass, or as the row's `rank`th logit and token.
__device__ __forceinline__ void top_write(u64 key, u32 i, u32 rank, u32 row, u32 k, u64* __restrict__ keys_out,
                                          float* __restrict__ out) {
    if (gridDim.x == 1) {
        out[(u64)row * 2 * k + rank] = key_logit(key);
        out[(u64)row * 2 * k + k + rank] = __uint_as_float(key_token(key));
    } else {
        keys_out[((u64)row * gridDim.x + blockIdx.x) * k + i] = key;
    }
}

// The k largest of the CTA's keys in k rounds, in order.
__device__ __forceinline__ void top_rounds(u64 (&key)[TOP_ITEMS], u32 row, u32 k, u64* __restrict__ keys_out,
                                           float* __restrict__ out) {
    __shared__ u64 warp_best[LAYER_THREADS / 32];
    const u32 lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    for (u32 round = 0; round < k; ++round) {
        u64 best = 0;
#pragma unroll
        for (int i = 0; i < TOP_ITEMS; ++i) best = key[i] > best ? key[i] : best;
#pragma unroll
        for (int off = 16; off; off >>= 1) {
            const u64 other = __shfl_xor_sync(0xFFFFFFFFu, best, off);
            best = other > best ? other : best;
        }
        if (lane == 0) warp_best[warp] = best;
        __syncthreads();
        best = warp_best[0];
#pragma unroll
        for (int w = 1; w < LAYER_THREADS / 32; ++w) best = warp_best[w] > best ? warp_best[w] : best;
        __syncthreads();
        // Keys are distinct, so only the holder of the block's largest clears it (a pad of 0
        // cleared again stays 0).
#pragma unroll
        for (int i = 0; i < TOP_ITEMS; ++i) key[i] = key[i] == best ? 0 : key[i];
        if (threadIdx.x == 0) top_write(best, round, round, row, k, keys_out, out);
    }
}

// The k largest of the CTA's keys by radix selection: a byte a pass from the highest, each
// pass counting the keys that agree with the bytes chosen so far by their next byte, and
// choosing the byte at which the count from the top reaches the keys still wanted; it ends
// where every key of the chosen bytes is wanted. The keys above the chosen bytes, and as many
// as are still wanted of those equal to them (only pads of 0 can be equal past the last
// byte), are the k; on the last pass each is put in its place by counting the kept keys
// above it.
__device__ __forceinline__ void top_select(const u64 (&key)[TOP_ITEMS], u32 row, u32 k, u64* __restrict__ keys_out,
                                           float* __restrict__ out) {
    __shared__ u32 bins[256];
    __shared__ u32 chosen, above, taken, equal_taken;
    __shared__ u64 kept[TOP_SEGMENT / 2];
    const u32 lane = threadIdx.x % 32;
    u64 prefix = 0, mask = 0;
    u32 want = k;
    for (int shift = 56; shift >= 0; shift -= 8) {
        for (u32 b = threadIdx.x; b < 256; b += LAYER_THREADS) bins[b] = 0;
        __syncthreads();
#pragma unroll
        for (int i = 0; i < TOP_ITEMS; ++i) {
            // Lanes counting into one bin add once, together.
            const bool agrees = (key[i] & mask) == prefix;
            const u32 bin = agrees ? (u32)(key[i] >> shift) & 255u : 256u;
            const u32 peers = __match_any_sync(0xFFFFFFFFu, bin);
            if (agrees && lane == (u32)__ffs(peers) - 1) atomicAdd(&bins[bin], (u32)__popc(peers));
        }
        __syncthreads();
        if (threadIdx.x < 32) {
            // Lane L holds bins 255 - 8L down to 248 - 8L; the lane whose share of the count
            // from the top reaches `want` finds the bin.
            u32 count[8], sum = 0;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                count[j] = bins[255 - 8 * lane - j];
                sum += count[j];
            }
            u32 through = sum;
#pragma unroll
            for (int o = 1; o < 32; o *= 2) {
                const u32 y = __shfl_up_sync(0xFFFFFFFFu, through, o);
                if ((int)lane >= o) through += y;
            }
            u32 before = through - sum;
            if (before < want && want <= through) {
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    if (before + count[j] >= want) {
                        chosen = 255 - 8 * lane - j;
                        above = before;
                        break;
                    }
                    before += count[j];
                }
            }
        }
        __syncthreads();
        const u32 bin = chosen;
        want -= above;
        prefix |= (u64)bin << shift;
        mask |= (u64)0xFF << shift;
        const bool every = bins[bin] == want;
        __syncthreads();  // every thread has read the bins before the next pass clears them
        if (every) break;
    }
    if (threadIdx.x == 0) taken = equal_taken = 0;
    __syncthreads();
#pragma unroll
    for (int i = 0; i < TOP_ITEMS; ++i) {
        const u64 top_bytes = key[i] & mask;
        const bool keep = top_bytes > prefix || (top_bytes == prefix && atomicAdd(&equal_taken, 1u) < want);
        if (keep) kept[atomicAdd(&taken, 1u)] = key[i];
    }
    __syncthreads();
    for (u32 i = threadIdx.x; i < k; i += LAYER_THREADS) {
        u32 rank = 0;
        if (gridDim.x == 1) {
            // Equal keys (pads) take their places by where they were kept.
            for (u32 j = 0; j < k; ++j) rank += kept[j] > kept[i] || (kept[j] == kept[i] && j < i);
        }
        top_write(kept[i], i, rank, row, k, keys_out, out);
    }
}

extern "C" __global__ void __launch_bounds__(LAYER_THREADS)
top_logits(const float* __restrict__ logits, const u64* __restrict__ keys_in, u32 n, u32 from_logits,
           u32 k, u64* __restrict__ keys_out, float* __restrict__ out) {
    let_next_grid_launch();
    wait_for_previous_grid();
    const u32 row = blockIdx.y, segment = blockIdx.x;
    u64 key[TOP_ITEMS];
#pragma unroll
    for (int i = 0; i < TOP_ITEMS; ++i) {
        const u32 j = segment * TOP_SEGMENT + i * LAYER_THREADS + threadIdx.x;
        key[i] = 0;
        if (j < n) key[i] = from_logits ? logit_key(logits[(u64)row * n + j], j) : keys_in[(u64)row * n + j];
    }
    if (k <= TOP_ROUNDS_MAX) {
        top_rounds(key, row, k, keys_out, out);
    } else {
        top_select(key, row, k, keys_out, out);
    }
}

// A CTA's reduction of one float per thread by `op` (max or sum), the result in every thread;
// `part` is LAYER_THREADS / 32 floats of shared memory, free again on return.
template <typename Op> __device__ __forceinline__ float block_reduce(float x, float* part, Op op) {
#pragma unroll
    for (int o = 16; o > 0; o /= 2) x = op(x, __shfl_xor_sync(0xffffffffu, x, o));
    if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = x;
    __syncthreads();
    x = part[0];
#pragma unroll
    for (int w = 1; w < LAYER_THREADS / 32; ++w) x = op(x, part[w]);
    __syncthreads();
    return x;
}

// A row's largest logit `m` and the sum of exp((x - m) * scale) over its `cols` logits, in
// fp32, by the whole CTA; the results are in every thread. One CTA reads a whole row (a
// vocabulary: hundreds of KB), so a 16-byte-aligned row of whole float4s is read a float4 at
// a time, several loads in flight per thread; the order of the sums is fixed either way.
__device__ __forceinline__ float row_softmax_sum(const float* row, u32 cols, float scale, float* part,
                                                 float& m) {
    const bool by4 = cols % 4 == 0 && ((u64)row & 15) == 0;
    const float4* row4 = reinterpret_cast<const float4*>(row);
    const u32 n4 = by4 ? cols / 4 : 0;
    m = NEG_INF;
#pragma unroll 8
    for (u32 c = threadIdx.x; c < n4; c += LAYER_THREADS) {
        const float4 v = row4[c];
        m = fmaxf(m, fmaxf(fmaxf(v.x, v.y), fmaxf(v.z, v.w)));
    }
    for (u32 c = 4 * n4 + threadIdx.x; c < cols; c += LAYER_THREADS) m = fmaxf(m, row[c]);
    m = block_reduce(m, part, [](float a, float b) { return fmaxf(a, b); });
    float s = 0.f;
#pragma unroll 8
    for (u32 c = threadIdx.x; c < n4; c += LAYER_THREADS) {
        const float4 v = row4[c];
        s += expf((v.x - m) * scale) + expf((v.y - m) * scale) + expf((v.z - m) * scale) +
             expf((v.w - m) * scale);
    }
    for (u32 c = 4 * n4 + threadIdx.x; c < cols; c += LAYER_THREADS) s += expf((row[c] - m) * scale);
    return block_reduce(s, part, [](float a, float b) { return a + b; });
}

// One CTA per row of `logits` (rows x cols): the row's log-normaliser ln sum exp(x) (its max,
// then the sum of exp(x - max), in fp32) and the logit of its target token, into out[2 row]
// and out[2 row + 1] (the host checked every target against cols).
extern "C" __global__ void __launch_bounds__(LAYER_THREADS)
logprob_terms(const float* __restrict__ logits, const u32* __restrict__ targets, u32 cols,
              float* __restrict__ out) {
    let_next_grid_launch();
    wait_for_previous_grid();
    __shared__ float part[LAYER_THREADS / 32];
    const float* row = logits + (u64)blockIdx.x * cols;
    float m;
    const float s = row_softmax_sum(row, cols, 1.f, part, m);
    if (threadIdx.x == 0) {
        out[2 * (u64)blockIdx.x] = m + logf(s);
        out[2 * (u64)blockIdx.x + 1] = row[targets[blockIdx.x]];
    }
}

// One CTA per row of `logits` (rows x cols): the sum of exp((x - max) / T) over the row, T
// the row's temperature (the host checked each is above 0), into out[row].
extern "C" __global__ void __launch_bounds__(LAYER_THREADS)
softmax_totals(const float* __restrict__ logits, const float* __restrict__ temperatures, u32 cols,
               float* __restrict__ out) {
    let_next_grid_launch();
    wait_for_previous_grid();
    __shared__ float part[LAYER_THREADS / 32];
    float m;
    const float s = row_softmax_sum(logits + (u64)blockIdx.x * cols, cols,
                                    1.f / temperatures[blockIdx.x], part, m);
    if (threadIdx.x == 0) out[blockIdx.x] = s;
}

// out[i] = the logit at picks[i] = (row, token) of `logits` (rows x cols; the host checked
// every pick against both).
extern "C" __global__ void pick_logits(const float* __restrict__ logits, const uint2* __restrict__ picks,
                                       u32 n, u32 cols, float* __restrict__ out) {
    GRID_STRIDE(i, (u64)n) {
        const uint2 p = picks[i];
        out[i] = logits[(u64)p.x * cols + p.y];
    }
}

// logits[places[i]] = values[i], or `value` where `values` is null, for each (row, token) of
// `places` (rows x cols; the host checked every place against both).
extern "C" __global__ void set_logits(float* __restrict__ logits, const uint2* __restrict__ places, u32 n,
                                      u32 cols, float value, const float* __restrict__ values) {
    GRID_STRIDE(i, (u64)n) {
        const uint2 p = places[i];
        logits[(u64)p.x * cols + p.y] = values ? values[i] : value;
    }
}
