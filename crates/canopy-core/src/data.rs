//! Problem data: random inputs that every backend and the oracle see identically.
//!
//! Values come from a counter-based hash, so any element can be regenerated independently: the
//! GPU fills multi-gigabyte KV caches in place (`crates/canopy-kernels/cuda/fill.cu` mirrors [`hash_uniform`] bit
//! for bit), and the f64 oracle regenerates rows on the CPU instead of copying them back.

use crate::dtype::{DType, TypedVec};
use crate::shape::AttnShape;

/// Hash streams of the three tensors.
pub const STREAM_Q: u32 = 0;
pub const STREAM_K: u32 = 1;
pub const STREAM_V: u32 = 2;
/// Queries are drawn wider than keys so softmax is far from flat and errors in the max and
/// rescale logic show.
pub const Q_AMPLITUDE: f32 = 2.0;
pub const KV_AMPLITUDE: f32 = 1.0;

pub fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Element `i` of `stream`: uniform in `[-amp, amp)` on a 2^-23 grid (exact in f32).
pub fn hash_uniform(seed: u64, stream: u32, i: u64, amp: f32) -> f32 {
    let h = splitmix64(seed ^ ((stream as u64) << 56) ^ i);
    (((h >> 40) as u32) as f32 * (1.0 / 8_388_608.0) - 1.0) * amp
}

/// Element `i` of a tensor as stored in `dtype`, widened back to f32.
pub fn hashed_element(seed: u64, stream: u32, i: u64, dtype: DType) -> f32 {
    let amp = if stream == STREAM_Q {
        Q_AMPLITUDE
    } else {
        KV_AMPLITUDE
    };
    dtype.round(hash_uniform(seed, stream, i, amp))
}

/// Queries (fp32, already representable in the KV dtype) and K, V in the KV dtype, laid out
/// `rows × heads × head_dim` and `tokens × kv_heads × head_dim`.
#[derive(Debug, Clone)]
pub struct ProblemData {
    pub seed: u64,
    pub q: Vec<f32>,
    pub k: TypedVec,
    pub v: TypedVec,
}

/// Hashed queries for `queries` rows of `shape`.
pub fn hashed_queries(shape: &AttnShape, dtype: DType, queries: usize, seed: u64) -> Vec<f32> {
    (0..(queries * shape.q_row_elems()) as u64)
        .map(|i| hashed_element(seed, STREAM_Q, i, dtype))
        .collect()
}

impl ProblemData {
    /// Fresh random data (never zeros) for `queries` rows and `tokens` tokens.
    pub fn random(
        shape: &AttnShape,
        dtype: DType,
        queries: usize,
        tokens: usize,
        seed: u64,
    ) -> Self {
        let n = (tokens * shape.kv_token_elems()) as u64;
        let gen = |stream| {
            (0..n)
                .map(|i| hashed_element(seed, stream, i, dtype))
                .collect::<Vec<f32>>()
        };
        ProblemData {
            seed,
            q: hashed_queries(shape, dtype, queries, seed),
            k: TypedVec::from_f32(dtype, &gen(STREAM_K)),
            v: TypedVec::from_f32(dtype, &gen(STREAM_V)),
        }
    }
}

/// Where the oracle reads K and V rows (one token's one KV head) from.
pub trait KvSource: Sync {
    /// Fills `k` and `v` (head_dim long) with the row of `token`, `kv_head`.
    fn rows(&self, token: usize, kv_head: usize, k: &mut [f32], v: &mut [f32]);
}

/// K and V held in memory as f32 (`tokens × kv_heads × head_dim`).
pub struct SliceKv<'a> {
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub kv_heads: usize,
}

impl KvSource for SliceKv<'_> {
    fn rows(&self, token: usize, kv_head: usize, k: &mut [f32], v: &mut [f32]) {
        let d = k.len();
        let at = (token * self.kv_heads + kv_head) * d;
        k.copy_from_slice(&self.k[at..at + d]);
        v.copy_from_slice(&self.v[at..at + d]);
    }
}

/// K and V regenerated from the hash, for caches too large to hold on the host.
pub struct HashedKv {
    pub seed: u64,
    pub dtype: DType,
    pub kv_heads: usize,
}

impl KvSource for HashedKv {
    fn rows(&self, token: usize, kv_head: usize, k: &mut [f32], v: &mut [f32]) {
        let d = k.len();
        let at = ((token * self.kv_heads + kv_head) * d) as u64;
        for i in 0..d {
            k[i] = hashed_element(self.seed, STREAM_K, at + i as u64, self.dtype);
            v[i] = hashed_element(self.seed, STREAM_V, at + i as u64, self.dtype);
        }
    }
}

/// Paged KV as the kernels see it: logical token `t` lives in physical slot
/// `table[t / page_size] * page_size + t % page_size` of `pool`.
pub struct PagedKv<'a, S: KvSource> {
    pub pool: &'a S,
    pub page_size: u32,
    pub table: &'a [u32],
}

impl<S: KvSource> KvSource for PagedKv<'_, S> {
    fn rows(&self, token: usize, kv_head: usize, k: &mut [f32], v: &mut [f32]) {
        let page = self.page_size as usize;
        let slot = self.table[token / page] as usize * page + token % page;
        self.pool.rows(slot, kv_head, k, v);
    }
}

/// The f64 oracle's outputs for `tree` over hashed data: the queries and KV every backend
/// generates from `seed` ([`hashed_queries`], [`HashedKv`]), so no tensor is copied back.
pub fn hashed_oracle(tree: &crate::KvTree, shape: &AttnShape, dtype: DType, seed: u64) -> Vec<f64> {
    let q = hashed_queries(shape, dtype, tree.num_queries(), seed);
    let kv = HashedKv {
        seed,
        dtype,
        kv_heads: shape.kv_heads,
    };
    crate::reference_attention(tree, shape, &q, &kv).0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_values_are_on_grid_and_in_range() {
        for i in 0..1000 {
            let x = hash_uniform(7, STREAM_K, i, 1.0);
            assert!((-1.0..1.0).contains(&x));
            assert_eq!((x + 1.0) * 8_388_608.0, ((x + 1.0) * 8_388_608.0).round());
        }
        // A pinned value guards the bit-for-bit contract with crates/canopy-kernels/cuda/fill.cu.
        assert_eq!(splitmix64(0), 0xE220_A839_7B1D_CDAF);
    }

    #[test]
    fn hashed_source_matches_materialised_data() {
        let shape = AttnShape::new(4, 2, 64).unwrap();
        let data = ProblemData::random(&shape, DType::Bf16, 1, 5, 11);
        let (k, v) = (data.k.to_f32_vec(), data.v.to_f32_vec());
        let slice = SliceKv {
            k: &k,
            v: &v,
            kv_heads: 2,
        };
        let hashed = HashedKv {
            seed: 11,
            dtype: DType::Bf16,
            kv_heads: 2,
        };
        let (mut a, mut b, mut c, mut d) = ([0.0; 64], [0.0; 64], [0.0; 64], [0.0; 64]);
        slice.rows(3, 1, &mut a, &mut b);
        hashed.rows(3, 1, &mut c, &mut d);
        assert_eq!((a, b), (c, d));
        assert!(a.iter().any(|&x| x != 0.0));
    }
}
