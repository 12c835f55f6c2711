// The rest of draws by a row's softmax total, walked past the row's likeliest tokens
// (canopy_core::logits::TailWalk); compiled after logits.cu as one program. A walk's row is
// spread over CTAs of WALK_CHUNK tokens, so that one walk takes as many SMs as many walks do:
// a step whose batch walks one row waits for it as long as for 64.
//   walk_masses  (a cut's) each token's fixed-point mass past the head, and the masses summed
//                into WALK_BINS bins by depth below the row's top;
//   walk_gather  (a cut's) the tokens of the bin where the masses from the top reach the cut's
//                need, each chunk's in token order;
//   walk_select  (a cut's, one CTA) the last kept token's key and id, by radix selection over
//                the gathered tokens, and the walk over the head in its order;
//   walk_sums    each chunk's sum of the probabilities the walk passes;
//   walk_land    (one CTA) the chunk, then the thread's run, then the token the target lands on.
// Every kernel's CTAs take index[5w..5w+5] = (row of `logits`, where the walk's head tokens
// start in `index` and how many, whether top_p cuts the walk (which then walks its head in the
// order given), and the row of `model` whose logit of the landed token is returned: the walked
// row may be a copy with a draw's changed logits in place) and params[7w..7w+7] = (top,
// temperature, total, target, u, top_p, head_mass), `top` the row's largest logit. Each
// probability is exp((x - top) / T) / total (the quotient in fp32, the rest in fp64).

#ifndef WALK_THREADS
#error "WALK_THREADS must be defined by the kernel registry"
#endif
#ifndef WALK_CHUNK
#error "WALK_CHUNK must be defined by the kernel registry"
#endif
#ifndef WALK_BINS
#error "WALK_BINS must be defined by the kernel registry"
#endif
// Tokens a thread of a chunk's CTA takes.
#define WALK_RUN (WALK_CHUNK / WALK_THREADS)
static_assert(WALK_RUN * WALK_THREADS == WALK_CHUNK, "a chunk is whole runs");
static_assert(WALK_BINS % WALK_THREADS == 0, "each thread scans as many bins");
// Bins a unit of (top - x) / T spans: WALK_BINS of them reach 21 units deep, past which a
// token's probability is below 1e-9 of the top's, and the last bin holds the rest.
#define WALK_BIN_SCALE 96.0f
// walk_select's warps count into WALK_BIN_SETS sets of bins, so that fewer atomics meet, and
// it holds up to WALK_CACHE gathered tokens' keys and masses in shared memory.
#define WALK_BIN_SETS 4
#define WALK_CACHE 2048
#define NO_TOKEN 0xffffffffu

// A token's probability in fixed point (FIXED_ONE to 1, 2^60), so that sums of them are exact
// and do not depend on their order.
#define FIXED_ONE 1152921504606846976.0
__device__ __forceinline__ u64 fixed_mass(double q) { return (u64)(q * FIXED_ONE); }

// The fp32 logit's bits in an order that follows its value (total_cmp's): a larger key is a
// larger logit.
__device__ __forceinline__ u32 order_key(float x) {
    const u32 b = __float_as_uint(x);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Inclusive scan of `x` over the CTA (`ends` as many entries of shared memory as threads, free
// again on return), in a fixed order of additions.
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

// The largest of the CTA's `x` in every thread (`part` is WALK_THREADS / 32 ints of shared
// memory, free again on return).
__device__ __forceinline__ int cta_max(int x, int* part) {
#pragma unroll
    for (int o = 16; o > 0; o /= 2) x = max(x, __shfl_xor_sync(0xffffffffu, x, o));
    if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = x;
    __syncthreads();
    int all = -1;
    for (u32 v = 0; v < WALK_THREADS / 32; ++v) all = max(all, part[v]);
    __syncthreads();
    return all;
}

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

// One walk as its CTAs read it.
struct Walk {
    const float* row;
    const float* model_row;
    const u32* head;
    u32 head_len;
    // Whether top_p cuts the walk.
    bool cut;
    float top, temperature;
    double total, target, u, top_p, head_mass;

    __device__ Walk(const float* logits, const float* model, u32 cols, const u32* index, const double* params, u32 w)
        : row(logits + (u64)index[5 * w] * cols),
          model_row(model + (u64)index[5 * w + 4] * cols),
          head(index + index[5 * w + 1]),
          head_len(index[5 * w + 2]),
          cut(index[5 * w + 3] != 0),
          top((float)params[7 * w]),
          temperature((float)params[7 * w + 1]),
          total(params[7 * w + 2]),
          target(params[7 * w + 3]),
          u(params[7 * w + 4]),
          top_p(params[7 * w + 5]),
          head_mass(params[7 * w + 6]) {}

    // Token t's probability, as the host takes it.
    __device__ double prob(u32 t) const { return exp((double)((row[t] - top) / temperature)) / total; }

    // The masses past the head the cut keeps, in fixed point (at least one unit, so that the
    // cut keeps a token).
    __device__ u64 need() const {
        const u64 need = fixed_mass(top_p - head_mass);
        return need > 0 ? need : 1;
    }

    // Token t's bin: (top - x) / T in steps of 1 / WALK_BIN_SCALE, the last bin holding
    // everything deeper. Each step is monotone, so a likelier token never lies in a later bin
    // (equal logits share one); only tokens of a mass above 0 are binned, so the bins of NaNs
    // do not matter.
    __device__ u32 bin(u32 t) const {
        const float depth = (top - row[t]) / temperature * WALK_BIN_SCALE;
        return depth < (float)(WALK_BINS - 1) ? (u32)fmaxf(depth, 0.0f) : WALK_BINS - 1;
    }
};

// What walk_select leaves for the rest of a cut walk: the kept tokens past the head are those
// whose key is above key_cut, and those of key_cut up to token id_cut; where the head walk
// landed (`done`), `token` is the draw's.
struct WalkState {
    double target;
    u32 key_cut, id_cut, token, done;
    int last_head;
};
static_assert(sizeof(WalkState) == 4 * 8, "walks.rs allocates four 8-byte words a walk");

// The state a walk goes on with: its cut's, or for a walk without one, every token past the
// head kept and its own target.
__device__ __forceinline__ WalkState state_of(const Walk& walk, const WalkState* states, u32 w) {
    if (walk.cut) return states[w];
    WalkState s;
    s.target = walk.target;
    s.key_cut = 0;
    s.id_cut = NO_TOKEN;
    s.token = NO_TOKEN;
    s.done = 0;
    s.last_head = -1;
    return s;
}

// Whether token t (logit x), past the head, is kept.
__device__ __forceinline__ bool is_kept(const WalkState& s, u32 t, float x) {
    const u32 key = order_key(x);
    return key > s.key_cut || (key == s.key_cut && t <= s.id_cut);
}

// Marks in `bits` (WALK_CHUNK / 32 words of shared memory) the head tokens in the chunk from
// `from`, by the whole CTA.
__device__ __forceinline__ void mark_head(u32* bits, const Walk& walk, u32 from) {
    for (u32 i = threadIdx.x; i < WALK_CHUNK / 32; i += WALK_THREADS) bits[i] = 0;
    __syncthreads();
    for (u32 i = threadIdx.x; i < walk.head_len; i += WALK_THREADS) {
        const u32 t = walk.head[i];
        if (t >= from && t - from < WALK_CHUNK) atomicOr(&bits[(t - from) / 32], 1u << ((t - from) % 32));
    }
    __syncthreads();
}

__device__ __forceinline__ bool marked(const u32* bits, u32 i) { return (bits[i / 32] >> (i % 32)) & 1u; }

// The first bin, likeliest first, at which the masses of `bins` from the top reach `need`,
// with the masses before it (`above`) and all of them (`all`); `bin` is WALK_BINS where they
// never do. By the whole CTA (`ends`: WALK_THREADS entries of shared memory).
struct Crossing {
    u32 bin;
    u64 above, all;
};
__device__ __forceinline__ Crossing crossing_bin(const u64* bins, u64 need, u64* ends, Crossing* shared) {
    constexpr u32 per = WALK_BINS / WALK_THREADS;
    u64 own = 0;
#pragma unroll
    for (u32 j = 0; j < per; ++j) own += bins[threadIdx.x * per + j];
    const u64 end = cta_scan<u64>(own, ends);
    if (threadIdx.x == WALK_THREADS - 1) *shared = Crossing{WALK_BINS, end, end};
    __syncthreads();
    u64 before = end - own;
    if (before < need && need <= end) {
        for (u32 j = 0; j < per; ++j) {
            const u64 b = bins[threadIdx.x * per + j];
            if (before + b >= need) {
                shared->bin = threadIdx.x * per + j;
                shared->above = before;
                break;
            }
            before += b;
        }
    }
    __syncthreads();
    const Crossing x = *shared;
    __syncthreads();
    return x;
}

// The probabilities of this thread's run of chunk c (WALK_RUN tokens from c · WALK_CHUNK +
// thread · WALK_RUN) that the walk passes, summed in token order, and the last of them above
// 0 (-1 where none is); `head_bits` marks the chunk's head tokens.
__device__ __forceinline__ double run_sum(const Walk& walk, const WalkState& s, const u32* head_bits, u32 c, u32 cols,
                                          int& last) {
    const u32 from = c * WALK_CHUNK + threadIdx.x * WALK_RUN;
    double q[WALK_RUN];
#pragma unroll
    for (int j = 0; j < WALK_RUN; ++j) q[j] = walk.prob(min(from + j, cols - 1));
    double sum = 0.0;
    last = -1;
#pragma unroll
    for (int j = 0; j < WALK_RUN; ++j) {
        const u32 t = from + j;
        if (t < cols && !marked(head_bits, t - c * WALK_CHUNK) && is_kept(s, t, walk.row[t])) {
            sum += q[j];
            if (q[j] > 0.0) last = (int)t;
        }
    }
    return sum;
}

#define WALK_ARGS                                                                                          \
    const float *__restrict__ logits, const float *__restrict__ model, u32 cols, const u32 *__restrict__ index, \
        const double *__restrict__ params
#define WALK_OF(w) Walk(logits, model, cols, index, params, (w))

// CTA (chunk, cut walk): each token's fixed-point mass past the head into masses (walks × cols;
// the head's 0), and the chunk's masses added into the walk's bins (walks × WALK_BINS, zeroed
// before).
extern "C" __global__ void __launch_bounds__(WALK_THREADS)
walk_masses(WALK_ARGS, u64* __restrict__ masses, u64* __restrict__ bins) {
    __shared__ u64 local[WALK_BINS];
    __shared__ u32 head_bits[WALK_CHUNK / 32];
    const u32 w = blockIdx.y, c = blockIdx.x;
    const Walk walk = WALK_OF(w);
    if (!walk.cut) return;
    for (u32 b = threadIdx.x; b < WALK_BINS; b += WALK_THREADS) local[b] = 0;
    mark_head(head_bits, walk, c * WALK_CHUNK);
    u64* mass = masses + (u64)w * cols;
    // Strided, so that the loads coalesce, every exponential in flight before any is used.
    double q[WALK_RUN];
#pragma unroll
    for (int j = 0; j < WALK_RUN; ++j) q[j] = walk.prob(min(c * WALK_CHUNK + threadIdx.x + j * WALK_THREADS, cols - 1));
#pragma unroll
    for (int j = 0; j < WALK_RUN; ++j) {
        const u32 i = threadIdx.x + j * WALK_THREADS, t = c * WALK_CHUNK + i;
        if (t >= cols) break;
        const u64 m = marked(head_bits, i) ? 0 : fixed_mass(q[j]);
        mass[t] = m;
        if (m > 0) atomicAdd((unsigned long long*)&local[walk.bin(t)], (unsigned long long)m);
    }
    __syncthreads();
    u64* walk_bins = bins + (u64)w * WALK_BINS;
    for (u32 b = threadIdx.x; b < WALK_BINS; b += WALK_THREADS)
        if (local[b] > 0) atomicAdd((unsigned long long*)&walk_bins[b], (unsigned long long)local[b]);
}

// CTA (chunk, cut walk): the chunk's tokens of a mass above 0 in the walk's crossing bin, in
// token order, into list (walks × cols, the chunk's from c · WALK_CHUNK), and how many into
// counts (walks × chunks).
extern "C" __global__ void __launch_bounds__(WALK_THREADS)
walk_gather(WALK_ARGS, const u64* __restrict__ masses, const u64* __restrict__ bins, u32* __restrict__ list,
            u32* __restrict__ counts) {
    __shared__ u64 ends[WALK_THREADS];
    __shared__ Crossing shared;
    const u32 w = blockIdx.y, c = blockIdx.x;
    const Walk walk = WALK_OF(w);
    if (!walk.cut) return;
    const Crossing x = crossing_bin(bins + (u64)w * WALK_BINS, walk.need(), ends, &shared);
    const u64* mass = masses + (u64)w * cols;
    const u32 from = c * WALK_CHUNK + threadIdx.x * WALK_RUN;
    bool hit[WALK_RUN];
    u32 n = 0;
#pragma unroll
    for (int j = 0; j < WALK_RUN; ++j) {
        const u32 t = from + j;
        hit[j] = x.bin < WALK_BINS && t < cols && walk.bin(t) == x.bin && mass[t] > 0;
        n += hit[j];
    }
    const u32 end = cta_scan<u32>(n, (u32*)ends);
    u32* out = list + (u64)w * cols + c * WALK_CHUNK;
    u32 at = end - n;
#pragma unroll
    for (int j = 0; j < WALK_RUN; ++j)
        if (hit[j]) out[at++] = from + j;
    if (threadIdx.x == WALK_THREADS - 1) counts[(u64)w * gridDim.x + c] = end;
}

// One CTA a cut walk: the fewest likeliest tokens past the head whose masses reach top_p -
// head_mass. The tokens of the bins before the crossing bin are kept; among the crossing bin's
// (gathered), a radix select, a byte of the logit's order key a pass, finds the key of the last
// one kept, then the tokens of that key by token id. The walk's target is u (head_mass + kept),
// walked over the head in order by one warp; what is left, the kept tokens and whether the
// head walk landed go to states[w]. counts (walks × chunks) becomes each chunk's first place
// among the gathered.
extern "C" __global__ void __launch_bounds__(WALK_THREADS)
walk_select(WALK_ARGS, const u64* __restrict__ masses, const u64* __restrict__ bins, const u32* __restrict__ list,
            u32* __restrict__ counts, WalkState* __restrict__ states) {
    __shared__ u64 ends[WALK_THREADS];
    __shared__ u64 warp_bins[WALK_BIN_SETS][256];
    __shared__ u64 byte_mass[256];
    __shared__ u32 cached_key[WALK_CACHE];
    __shared__ u64 cached_mass[WALK_CACHE];
    __shared__ Crossing shared;
    __shared__ u32 theta, kept_to;
    __shared__ u64 kept_mass, passed_mass;
    const u32 w = blockIdx.x, warp = threadIdx.x / 32, chunks = (cols + WALK_CHUNK - 1) / WALK_CHUNK;
    const Walk walk = WALK_OF(w);
    if (!walk.cut) return;
    const u64 need = walk.need();
    const Crossing x = crossing_bin(bins + (u64)w * WALK_BINS, need, ends, &shared);
    const u64* mass = masses + (u64)w * cols;
    // Every token past the head is kept where all of them do not reach the need.
    u32 key_cut = 0, id_cut = NO_TOKEN;
    if (threadIdx.x == 0) {
        kept_to = NO_TOKEN;
        kept_mass = x.all;
    }
    if (x.bin < WALK_BINS) {
        // The gathered tokens, chunk by chunk: counts become each chunk's first place.
        u32* first = counts + (u64)w * chunks;
        const u32 per_chunk = (chunks + WALK_THREADS - 1) / WALK_THREADS;
        const u32 c0 = min(chunks, threadIdx.x * per_chunk), c1 = min(chunks, c0 + per_chunk);
        u32 own = 0;
        for (u32 c = c0; c < c1; ++c) own += first[c];
        const u32 end = cta_scan<u32>(own, (u32*)ends);
        for (u32 c = c0, at = end - own; c < c1; ++c) {
            const u32 n = first[c];
            first[c] = at;
            at += n;
        }
        if (threadIdx.x == WALK_THREADS - 1) theta = end;
        __syncthreads();
        const u32 m = theta;
        __syncthreads();
        // The g-th gathered token: in the last chunk whose first place is at most g.
        auto gathered = [&](u32 g) {
            u32 lo = 0, hi = chunks;
            while (hi - lo > 1) {
                const u32 mid = (lo + hi) / 2;
                if (first[mid] <= g) lo = mid; else hi = mid;
            }
            return list[(u64)w * cols + lo * WALK_CHUNK + (g - first[lo])];
        };
        const bool cache = m <= WALK_CACHE;
        for (u32 g = threadIdx.x; cache && g < m; g += WALK_THREADS) {
            const u32 t = gathered(g);
            cached_key[g] = order_key(walk.row[t]);
            cached_mass[g] = mass[t];
        }
        __syncthreads();
        auto key_at = [&](u32 g) { return cache ? cached_key[g] : order_key(walk.row[gathered(g)]); };
        auto mass_at = [&](u32 g) { return cache ? cached_mass[g] : mass[gathered(g)]; };
        // The key of the last token kept: a byte a pass, from the highest, each pass summing the
        // masses of the tokens whose keys agree with it so far, by their next byte, and taking
        // the byte at which the masses from the top reach the need. The crossing bin's masses
        // reach it, so some byte does each pass.
        u32 prefix = 0, mask = 0;
        u64 above = x.above;
        for (int pass = 0; pass < 4; ++pass) {
            const int shift = 24 - 8 * pass;
            u64* own_bins = warp_bins[warp % WALK_BIN_SETS];
            for (u32 i = threadIdx.x; i < WALK_BIN_SETS * 256; i += WALK_THREADS) (&warp_bins[0][0])[i] = 0;
            __syncthreads();
            for (u32 g = threadIdx.x; g < m; g += WALK_THREADS) {
                const u32 key = key_at(g);
                if ((key & mask) == prefix)
                    atomicAdd((unsigned long long*)&own_bins[(key >> shift) & 255], (unsigned long long)mass_at(g));
            }
            __syncthreads();
            for (u32 b = threadIdx.x; b < 256; b += WALK_THREADS) {
                u64 sum = 0;
                for (u32 v = 0; v < WALK_BIN_SETS; ++v) sum += warp_bins[v][b];
                byte_mass[b] = sum;
            }
            __syncthreads();
            // Thread i takes byte 255 - i: the scan sums the bytes from the top.
            if (threadIdx.x == 0) {
                theta = 0;
                passed_mass = above;
            }
            const u64 own = threadIdx.x < 256 ? byte_mass[255 - threadIdx.x] : 0;
            const u64 through = above + cta_scan<u64>(own, ends);
            if (threadIdx.x < 256 && through - own < need && need <= through) {
                theta = 255 - threadIdx.x;
                passed_mass = through - own;
            }
            __syncthreads();
            above = passed_mass;
            prefix |= theta << shift;
            mask |= 0xffu << shift;
            __syncthreads();
        }
        // The tokens of the last key, by token id (the gathered are in token order), until the
        // kept mass reaches the need.
        const u32 per = (m + WALK_THREADS - 1) / WALK_THREADS;
        const u32 g0 = min(m, threadIdx.x * per), g1 = min(m, g0 + per);
        u64 ties = 0;
        for (u32 g = g0; g < g1; ++g)
            if (key_at(g) == prefix) ties += mass_at(g);
        const u64 tie_end = cta_scan<u64>(ties, ends);
        const u64 more = need - above;
        if (tie_end - ties < more && more <= tie_end) {
            u64 sum = tie_end - ties;
            for (u32 g = g0; g < g1; ++g) {
                if (key_at(g) != prefix) continue;
                sum += mass_at(g);
                if (sum >= more) {
                    kept_to = gathered(g);
                    kept_mass = above + sum;
                    break;
                }
            }
        }
        key_cut = prefix;
        __syncthreads();
        id_cut = kept_to;
    }
    __syncthreads();
    if (threadIdx.x < 32) {
        double left = walk.u * (walk.head_mass + (double)kept_mass / FIXED_ONE);
        int passed = -1;
        const u32 at = warp_walk(walk.head_len, left, passed, [&](u32 i) { return walk.prob(walk.head[i]); });
        if (threadIdx.x == 0) {
            WalkState s;
            s.target = left;
            s.key_cut = key_cut;
            s.id_cut = id_cut;
            s.done = at < walk.head_len;
            s.token = s.done ? walk.head[at] : NO_TOKEN;
            s.last_head = passed >= 0 ? (int)walk.head[passed] : -1;
            states[w] = s;
        }
    }
}

// CTA (chunk, walk): the sum of the probabilities the walk passes in the chunk, each thread's
// run summed in token order and the runs in a fixed order, into sums (walks × chunks), and its
// last token of a probability above 0 (-1 where none is) into lasts.
extern "C" __global__ void __launch_bounds__(WALK_THREADS)
walk_sums(WALK_ARGS, const WalkState* __restrict__ states, double* __restrict__ sums, int* __restrict__ lasts) {
    __shared__ double ends[WALK_THREADS];
    __shared__ u32 head_bits[WALK_CHUNK / 32];
    __shared__ int part[WALK_THREADS / 32];
    const u32 w = blockIdx.y, c = blockIdx.x;
    const Walk walk = WALK_OF(w);
    const WalkState s = state_of(walk, states, w);
    if (s.done) return;
    mark_head(head_bits, walk, c * WALK_CHUNK);
    int last;
    const double sum = run_sum(walk, s, head_bits, c, cols, last);
    const double end = cta_scan<double>(sum, ends);
    last = cta_max(last, part);
    if (threadIdx.x == WALK_THREADS - 1) {
        sums[(u64)w * gridDim.x + c] = end;
        lasts[(u64)w * gridDim.x + c] = last;
    }
}

// One CTA a walk: the chunks' sums tile [0, their sum), and the chunk whose tile holds the
// target is walked as walk_sums summed it: the thread's run whose tile holds what is left, and
// in it the token, by one warp (warp_walk). A target past every tile lands on the last token
// walked with a probability above 0 (for a cut, else the last of its head). out[2w] = the
// token's bits (0xffffffff: none), out[2w + 1] its logit in the model's row.
extern "C" __global__ void __launch_bounds__(WALK_THREADS)
walk_land(WALK_ARGS, const WalkState* __restrict__ states, const double* __restrict__ sums,
          const int* __restrict__ lasts, float* __restrict__ out) {
    __shared__ double ends[WALK_THREADS];
    __shared__ u32 head_bits[WALK_CHUNK / 32];
    __shared__ int part[WALK_THREADS / 32];
    __shared__ u32 landed, crossing;
    __shared__ double left_in;
    __shared__ int crossing_last;
    const u32 w = blockIdx.x, chunks = (cols + WALK_CHUNK - 1) / WALK_CHUNK;
    const Walk walk = WALK_OF(w);
    const WalkState s = state_of(walk, states, w);
    if (!s.done) {
        const double* walk_sums = sums + (u64)w * chunks;
        const int* walk_lasts = lasts + (u64)w * chunks;
        // The chunks' tiles: each thread sums a contiguous range of them.
        const u32 per = (chunks + WALK_THREADS - 1) / WALK_THREADS;
        const u32 c0 = min(chunks, threadIdx.x * per), c1 = min(chunks, c0 + per);
        double own = 0.0;
        int latest = -1;
        for (u32 c = c0; c < c1; ++c) {
            own += walk_sums[c];
            latest = max(latest, walk_lasts[c]);
        }
        const double end = cta_scan<double>(own, ends);
        ends[threadIdx.x] = end;
        latest = cta_max(latest, part);
        if (threadIdx.x == 0) {
            landed = latest >= 0 ? (u32)latest : (s.last_head >= 0 ? (u32)s.last_head : NO_TOKEN);
            crossing = NO_TOKEN;
        }
        __syncthreads();
        double start = threadIdx.x == 0 ? 0.0 : ends[threadIdx.x - 1];
        for (u32 c = c0; c < c1; ++c) {
            const double next = c + 1 == c1 ? end : start + walk_sums[c];
            if (start <= s.target && s.target < next) {
                crossing = c;
                left_in = s.target - start;
            }
            start = next;
        }
        __syncthreads();
        const u32 c = crossing;
        if (c != NO_TOKEN) {
            // The chunk's runs, summed as walk_sums did.
            mark_head(head_bits, walk, c * WALK_CHUNK);
            int last;
            const double sum = run_sum(walk, s, head_bits, c, cols, last);
            const double run_end = cta_scan<double>(sum, ends);
            ends[threadIdx.x] = run_end;
            if (threadIdx.x == 0) {
                crossing = NO_TOKEN;
                // Where rounding leaves what is left past the chunk's runs: its last token.
                landed = walk_lasts[c] >= 0 ? (u32)walk_lasts[c] : landed;
            }
            __syncthreads();
            const double left = left_in, run_start = threadIdx.x == 0 ? 0.0 : ends[threadIdx.x - 1];
            if (run_start <= left && left < run_end) {
                crossing = threadIdx.x;
                crossing_last = last;
            }
            __syncthreads();
            if (threadIdx.x < 32 && crossing != NO_TOKEN) {
                const u32 from = c * WALK_CHUNK + crossing * WALK_RUN;
                double rest = left - (crossing == 0 ? 0.0 : ends[crossing - 1]);
                int passed = -1;
                const u32 at = warp_walk(WALK_RUN, rest, passed, [&](u32 i) {
                    const u32 t = from + i;
                    return t < cols && !marked(head_bits, t - c * WALK_CHUNK) && is_kept(s, t, walk.row[t]) ? walk.prob(t)
                                                                                                        : 0.0;
                });
                if (threadIdx.x == 0) landed = at < WALK_RUN ? from + at : (u32)crossing_last;
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        const u32 token = s.done ? s.token : landed;
        out[2 * (u64)w] = __uint_as_float(token);
        out[2 * (u64)w + 1] = token == NO_TOKEN ? __int_as_float(0x7fc00000) : walk.model_row[token];
    }
}
