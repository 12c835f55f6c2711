//! Random problem data, drawn once and shared by every backend and the oracle.

use crate::dtype::{DType, TypedVec};
use crate::shape::AttnShape;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Queries (fp32, already representable in the KV dtype) and K, V in the KV dtype, laid out
/// `rows × heads × head_dim` and `tokens × kv_heads × head_dim`.
#[derive(Debug, Clone)]
pub struct ProblemData {
    pub q: Vec<f32>,
    pub k: TypedVec,
    pub v: TypedVec,
}

impl ProblemData {
    /// Fresh uniform random data (never zeros). Queries are drawn wider than keys so softmax is
    /// far from flat and errors in the max/rescale logic show.
    pub fn random(
        shape: &AttnShape,
        dtype: DType,
        queries: usize,
        tokens: usize,
        seed: u64,
    ) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut draw = |n: usize, amp: f32| -> Vec<f32> {
            (0..n)
                .map(|_| dtype.round(rng.gen_range(-amp..amp)))
                .collect()
        };
        let q = draw(queries * shape.q_row_elems(), 2.0);
        let k = draw(tokens * shape.kv_token_elems(), 1.0);
        let v = draw(tokens * shape.kv_token_elems(), 1.0);
        ProblemData {
            q,
            k: TypedVec::from_f32(dtype, &k),
            v: TypedVec::from_f32(dtype, &v),
        }
    }
}
