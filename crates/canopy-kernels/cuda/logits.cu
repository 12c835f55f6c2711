// The ops on a pass's logits, compiled after layers.cu as one program (the kernel registry's
// Layers variant): each row narrowed to its likeliest tokens, its log-normaliser, its softmax
// total at a temperature, single logits read and written, and the rest of a draw by total
// walked past a row's likeliest tokens.

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
// fp32, by the whole CTA; the results are in every thread.
__device__ __forceinline__ float row_softmax_sum(const float* row, u32 cols, float scale, float* part,
                                                 float& m) {
    m = NEG_INF;
    for (u32 c = threadIdx.x; c < cols; c += LAYER_THREADS) m = fmaxf(m, row[c]);
    m = block_reduce(m, part, [](float a, float b) { return fmaxf(a, b); });
    float s = 0.f;
    for (u32 c = threadIdx.x; c < cols; c += LAYER_THREADS) s += expf((row[c] - m) * scale);
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

// The fp32 logit's bits in an order that follows its value (total_cmp's): a larger key is a
// larger logit.
__device__ __forceinline__ u32 order_key(float x) {
    const u32 b = __float_as_uint(x);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// A token's probability in fixed point (FIXED_ONE to 1, 2^60), so that sums of them are exact
// and do not depend on their order.
#define FIXED_ONE 1152921504606846976.0
__device__ __forceinline__ u64 fixed_mass(double q) { return (u64)(q * FIXED_ONE); }

// Whether `t` is one of the `n` sorted `head` tokens at or past index `h`, moving `h` on: a
// thread's run of tokens in order meets them in order.
__device__ __forceinline__ bool in_head(const u32* head, u32 n, u32& h, u32 t) {
    if (h < n && head[h] == t) {
        ++h;
        return true;
    }
    return false;
}

// Inclusive scan of `x` over the CTA (LAYER_THREADS threads, `ends` as many entries of shared
// memory, free again on return), in a fixed order of additions.
template <typename T>
__device__ __forceinline__ T cta_scan(T x, T* ends) {
    const u32 lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
    for (int o = 1; o < 32; o *= 2) {
        const T y = __shfl_up_sync(0xffffffffu, x, o);
        if ((int)lane >= o) x += y;
    }
    ends[threadIdx.x] = x;
    __syncthreads();
    T before = 0;
    for (u32 v = 0; v < warp; ++v) before += ends[v * 32 + 31];
    __syncthreads();
    return before + x;
}

#ifndef WALK_THREADS
#error "WALK_THREADS must be defined by the kernel registry"
#endif
// walk_tails' threads compute WALK_ILP exponentials at a time, and issue the loads of
// WALK_LOADS tokens at a time in a cut's radix passes, so that each has many in flight; its
// warps count a cut's masses into WALK_BIN_SETS sets of bins, so that fewer atomics meet.
#define WALK_ILP 4
#define WALK_LOADS 8
#define WALK_BIN_SETS 8

// A warp's walk over `n` candidates in order, candidate i's probability q_at(i) (0 for one not
// walked): the index of the first the target `left` falls below, as the host walks them one
// by one (here 32 at a time, by a scan of their probabilities), or n where it passes them all;
// `left` loses what it passes, and `last` becomes the last index passed with a probability
// above 0.
template <typename Q>
__device__ __forceinline__ u32 warp_walk(u32 n, double& left, int& last, Q q_at) {
    const u32 lane = threadIdx.x % 32;
    for (u32 base = 0; base < n; base += 32) {
        const u32 i = base + lane;
        const double q = i < n ? q_at(i) : 0.0;
        double through = q;
#pragma unroll
        for (int o = 1; o < 32; o *= 2) {
            const double y = __shfl_up_sync(0xffffffffu, through, o);
            if ((int)lane >= o) through += y;
        }
        const u32 hit = __ballot_sync(0xffffffffu, q > 0.0 && left < through);
        if (hit) return base + __ffs(hit) - 1;
        const u32 positive = __ballot_sync(0xffffffffu, q > 0.0);
        if (positive) last = (int)(base + 31 - __clz(positive));
        left -= __shfl_sync(0xffffffffu, through, 31);
    }
    return n;
}

// The index of the first of the n sorted head tokens at or past t (n where none is).
__device__ __forceinline__ u32 head_from(const u32* head, u32 n, u32 t) {
    u32 lo = 0, hi = n;
    while (lo < hi) {
        const u32 mid = (lo + hi) / 2;
        if (head[mid] < t) lo = mid + 1; else hi = mid;
    }
    return lo;
}

// Whether t is one of the n sorted head tokens.
__device__ __forceinline__ bool head_has(const u32* head, u32 n, u32 t) {
    const u32 at = head_from(head, n, t);
    return at < n && head[at] == t;
}

// Each token of the run [begin, end) past the head (whose first token at or past `begin` is
// head[first]) that `walked` keeps, with its probability, to `take`, in token order; the
// probabilities of WALK_ILP tokens at a time are computed before any is taken, so that their
// exponentials are in flight together.
template <typename Walked, typename Prob, typename Take>
__device__ __forceinline__ void run_probs(u32 begin, u32 end, const u32* head, u32 head_len, u32 first,
                                          Walked walked, Prob prob, Take take) {
    u32 h = first;
    for (u32 t0 = begin; t0 < end; t0 += WALK_ILP) {
        double q[WALK_ILP];
        bool kept[WALK_ILP];
#pragma unroll
        for (int j = 0; j < WALK_ILP; ++j) {
            const u32 t = t0 + j;
            kept[j] = t < end && !in_head(head, head_len, h, t) && walked(t);
            q[j] = prob(min(t, end - 1));
        }
#pragma unroll
        for (int j = 0; j < WALK_ILP; ++j)
            if (kept[j]) take(t0 + j, q[j]);
    }
}

// One CTA of WALK_THREADS per walk: the rest of a draw by a row's softmax total past the row's
// likeliest tokens (canopy_core::logits::TailWalk). index[6w..6w+6] = (row of logits, first and
// count of the walk's head tokens in `heads`, sorted, then first and count of its head in walk
// order, for a cut, then the row of `model` whose logit of the landed token is returned: the
// walked row may be a copy with a draw's changed logits in place); params[7w..7w+7] = (top,
// temperature, total, target, u, top_p, head_mass), `top` the row's largest logit. Each
// probability is exp((x - top) / T) / total (the quotient in fp32, the rest in fp64).
// A walk with a cut (a head in walk order) first keeps the fewest likeliest tokens past the
// head whose masses reach top_p - head_mass: a radix select, a byte of the logit's order key a
// pass, of masses in fixed point (its first pass stores every token's in `masses`, a row's worth
// a walk, for the later ones), then the tokens of the last key by token id. Its target is
// u (head_mass + kept), walked over the head in order (one warp) and then over the kept.
// The walk past the head: each thread sums the probabilities of a contiguous run of the row, a
// scan of the runs' sums tiles [0, sum) exactly, and warp 0 walks the run whose tile holds the
// target, 32 tokens at a time (warp_walk). A target past every tile lands on the last token
// walked with a probability above 0. out[2w] = the token's bits (0xffffffff: none), out[2w + 1]
// its logit in the model's row.
extern "C" __global__ void __launch_bounds__(WALK_THREADS)
walk_tails(const float* __restrict__ logits, const float* __restrict__ model, u32 cols,
           const u32* __restrict__ index, const double* __restrict__ params, const u32* __restrict__ heads,
           u64* __restrict__ masses, float* __restrict__ out) {
    __shared__ double ends[WALK_THREADS];
    __shared__ u64 counts[WALK_THREADS];
    __shared__ u64 warp_bins[WALK_BIN_SETS][256];
    __shared__ u32 landed, theta, kept_to, crossing;
    __shared__ int crossing_last;
    __shared__ u64 kept_mass;
    __shared__ double left_after_head;
    __shared__ int last_positive[WALK_THREADS / 32];
    const u32 w = blockIdx.x, warp = threadIdx.x / 32;
    const float* row = logits + (u64)index[6 * w] * cols;
    const u32* head = heads + index[6 * w + 1];
    const u32 head_len = index[6 * w + 2];
    const u32* order = heads + index[6 * w + 3];
    const u32 order_len = index[6 * w + 4];
    const float* model_row = model + (u64)index[6 * w + 5] * cols;
    const float top = (float)params[7 * w], temperature = (float)params[7 * w + 1];
    const double total = params[7 * w + 2];
    double target = params[7 * w + 3];
    const u32 per = (cols + WALK_THREADS - 1) / WALK_THREADS;
    const u32 begin = min(cols, threadIdx.x * per), end = min(cols, begin + per);
    // The first head token at or past this run.
    const u32 first = head_from(head, head_len, begin);
    // Each token's probability, as the host takes it.
    auto prob = [&](u32 t) { return exp((double)((row[t] - top) / temperature)) / total; };
    const bool cut = order_len > 0;
    int last_head = -1;
    if (threadIdx.x == 0) {
        landed = 0xffffffffu;
        theta = 0;
        kept_to = 0xffffffffu;
        crossing = 0xffffffffu;
    }
    if (cut) {
        const double top_p = params[7 * w + 5], head_mass = params[7 * w + 6];
        const u64 need = fixed_mass(top_p - head_mass);
        // The key of the last token kept: a byte a pass, from the highest, each pass summing the
        // masses of the tokens whose keys agree with it so far, by their next byte. The threads
        // stride the row.
        u64* mass = masses + (u64)w * cols;
        u32 prefix = 0, mask = 0;
        u64 above = 0;
        bool all = false;
        for (int pass = 0; pass < 4 && !all; ++pass) {
            const int shift = 24 - 8 * pass;
            u64* bins = counts;
            u64* own_bins = warp_bins[warp % WALK_BIN_SETS];
            for (u32 i = threadIdx.x; i < WALK_BIN_SETS * 256; i += WALK_THREADS) (&warp_bins[0][0])[i] = 0;
            __syncthreads();
            // The first pass stores every token's fixed-point mass, the head's as 0, so that the
            // later ones need not know the head: WALK_ILP exponentials a thread at a time, its
            // tokens meeting the sorted head in order.
            for (u32 t0 = threadIdx.x, h = 0; pass == 0 && t0 < cols; t0 += WALK_THREADS * WALK_ILP) {
                double q[WALK_ILP];
#pragma unroll
                for (int j = 0; j < WALK_ILP; ++j) q[j] = prob(min(t0 + j * WALK_THREADS, cols - 1));
#pragma unroll
                for (int j = 0; j < WALK_ILP; ++j) {
                    const u32 t = t0 + j * WALK_THREADS;
                    if (t >= cols) break;
                    while (h < head_len && head[h] < t) ++h;
                    const u64 m = h < head_len && head[h] == t ? 0 : fixed_mass(q[j]);
                    mass[t] = m;
                    atomicAdd((unsigned long long*)&own_bins[order_key(row[t]) >> 24], (unsigned long long)m);
                }
            }
            // The later ones read WALK_LOADS tokens a thread at a time, their loads all issued
            // before any is used.
            for (u32 t0 = threadIdx.x; pass > 0 && t0 < cols; t0 += WALK_THREADS * WALK_LOADS) {
                u32 key[WALK_LOADS];
                u64 m[WALK_LOADS];
#pragma unroll
                for (int j = 0; j < WALK_LOADS; ++j) {
                    const u32 t = min(t0 + j * WALK_THREADS, cols - 1);
                    key[j] = order_key(row[t]);
                    m[j] = mass[t];
                }
#pragma unroll
                for (int j = 0; j < WALK_LOADS; ++j)
                    if (t0 + j * WALK_THREADS < cols && (key[j] & mask) == prefix)
                        atomicAdd((unsigned long long*)&own_bins[(key[j] >> shift) & 255], (unsigned long long)m[j]);
            }
            __syncthreads();
            for (u32 b = threadIdx.x; b < 256; b += WALK_THREADS) {
                u64 sum = 0;
                for (u32 v = 0; v < WALK_BIN_SETS; ++v) sum += warp_bins[v][b];
                bins[b] = sum;
            }
            __syncthreads();
            if (threadIdx.x == 0) {
                u64 sum = above;
                int b = 255;
                for (; b >= 0; --b) {
                    if (sum + bins[b] >= need) break;
                    sum += bins[b];
                }
                kept_mass = sum;
                theta = b < 0 ? 0xffffffffu : (u32)b;
            }
            __syncthreads();
            if (theta == 0xffffffffu) {
                all = true;
            } else {
                above = kept_mass;
                prefix |= theta << shift;
                mask |= 0xffu << shift;
            }
            __syncthreads();
        }
        // The tokens of the last key, by token id, until the kept mass reaches the need.
        u64 ties = 0;
        if (!all) {
            for (u32 t = begin; t < end; ++t)
                if (order_key(row[t]) == prefix) ties += mass[t];
        }
        const u64 tie_end = cta_scan<u64>(ties, counts);
        const u64 tie_start = tie_end - ties;
        const u64 more = need - above;
        if (!all && tie_start < more && more <= tie_end) {
            u64 sum = tie_start;
            for (u32 t = begin; t < end; ++t) {
                // A head token's mass of 0 never reaches the need first.
                if (order_key(row[t]) != prefix) continue;
                sum += mass[t];
                if (sum >= more) {
                    kept_to = t;
                    kept_mass = above + sum;
                    break;
                }
            }
        }
        if (threadIdx.x == 0) theta = all ? 0u : prefix;
        __syncthreads();
        // Every token past the head is kept where the whole rest does not reach the need.
        u64 kept_sum = 0;
        if (all) {
            for (u32 t = threadIdx.x; t < cols; t += WALK_THREADS) kept_sum += mass[t];
        }
        const u64 all_mass = cta_scan<u64>(kept_sum, counts);
        if (all && threadIdx.x == WALK_THREADS - 1) kept_mass = all_mass;
        __syncthreads();
        if (threadIdx.x < 32) {
            double left = params[7 * w + 4] * (head_mass + (double)kept_mass / FIXED_ONE);
            int passed = -1;
            const u32 at = warp_walk(order_len, left, passed, [&](u32 i) { return prob(order[i]); });
            if (passed >= 0) last_head = (int)order[passed];
            if (threadIdx.x == 0) {
                if (at < order_len) landed = order[at];
                left_after_head = left;
                if (all) kept_to = 0xffffffffu;
            }
        }
        __syncthreads();
        if (landed != 0xffffffffu) {
            if (threadIdx.x == 0) {
                out[2 * (u64)w] = __uint_as_float(landed);
                out[2 * (u64)w + 1] = model_row[landed];
            }
            return;
        }
        target = left_after_head;
    }
    // Whether token t, past the head, is walked: all of them, or those a cut keeps.
    const u32 key_cut = theta, id_cut = kept_to;
    const bool keep_all = !cut || id_cut == 0xffffffffu;
    auto walked = [&](u32 t) {
        if (keep_all) return true;
        const u32 key = order_key(row[t]);
        return key > key_cut || (key == key_cut && t <= id_cut);
    };
    double sum = 0.0;
    int last = -1;
    run_probs(begin, end, head, head_len, first, walked, prob, [&](u32 t, double q) {
        sum += q;
        if (q > 0.0) last = (int)t;
    });
    // The runs' tiles: [the run before's end, this run's end).
    const double run_end = cta_scan<double>(sum, ends);
    ends[threadIdx.x] = run_end;
    int latest = last;
#pragma unroll
    for (int o = 16; o > 0; o /= 2) latest = max(latest, __shfl_xor_sync(0xffffffffu, latest, o));
    if (threadIdx.x % 32 == 0) last_positive[threadIdx.x / 32] = latest;
    __syncthreads();
    const double start = threadIdx.x == 0 ? 0.0 : ends[threadIdx.x - 1];
    if (start <= target && target < run_end) {
        crossing = threadIdx.x;
        crossing_last = last;
    }
    __syncthreads();
    if (threadIdx.x < 32 && crossing != 0xffffffffu) {
        const u32 c = crossing, from = min(cols, c * per), to = min(cols, from + per);
        double left = target - (c == 0 ? 0.0 : ends[c - 1]);
        int passed = -1;
        const u32 at = warp_walk(to - from, left, passed, [&](u32 i) {
            const u32 t = from + i;
            return head_has(head, head_len, t) || !walked(t) ? 0.0 : prob(t);
        });
        if (threadIdx.x == 0) landed = at < to - from ? from + at : (u32)crossing_last;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        u32 token = landed;
        if (token == 0xffffffffu) {
            int latest_all = -1;
            for (u32 v = 0; v < WALK_THREADS / 32; ++v) latest_all = max(latest_all, last_positive[v]);
            if (latest_all < 0) latest_all = last_head;
            token = latest_all < 0 ? 0xffffffffu : (u32)latest_all;
        }
        out[2 * (u64)w] = __uint_as_float(token);
        out[2 * (u64)w + 1] = token == 0xffffffffu ? __int_as_float(0x7fc00000) : model_row[token];
    }
}
