//! The random KV fill (`LayerOps::fill_kv_random`, `--context-fill random`): the CUDA backend
//! draws the values where it stores them, the CPU backend draws them on the host and stores
//! them with `store_kv`; both must leave the same bytes, so that a long context is the same
//! on any backend and rank count.
//!
//! Without a GPU every test prints why and passes. The seed is printed; `CANOPY_TEST_SEED`
//! repeats a run.

mod common;
use common::{gpu, rng};

use canopy_core::{AttnShape, DType, TypedVec};
use canopy_engine::{CpuBackend, FillRun, LayerOps, Result};
use rand::Rng;

const POOL: usize = 400;

/// K and V of every slot of a pool poisoned with NaN, then filled along `runs`.
fn filled<B: LayerOps>(
    b: &B,
    shape: &AttnShape,
    dtype: DType,
    seed: u64,
    runs: &[FillRun],
) -> Result<(Vec<f32>, Vec<f32>)> {
    let mut kv = b.alloc_kv(shape, dtype, POOL)?;
    let nan = TypedVec::from_f32(dtype, &vec![f32::NAN; POOL * shape.kv_token_elems()]);
    b.write_kv(&mut kv, 0, &nan, &nan)?;
    b.fill_kv_random(shape, &mut kv, seed, runs)?;
    let slots: Vec<u32> = (0..POOL as u32).collect();
    let (k, v) = b.load_kv(&kv, &slots)?;
    Ok((b.download_tensor(&k)?, b.download_tensor(&v)?))
}

/// Runs at scattered slots and positions (some past 2^32 elements), for every KV dtype and
/// two head shapes: the GPU's bytes equal the CPU's, bit for bit, and the slots outside the
/// runs keep their poison.
#[test]
fn random_fill_matches_the_host_draw() {
    let test = "random_fill_matches_the_host_draw";
    let Some(gpu) = gpu(test) else {
        return;
    };
    let mut rng = rng(test);
    for dtype in [DType::F32, DType::F16, DType::Bf16] {
        for (q_heads, kv_heads, head_dim) in [(32, 8, 128), (9, 3, 64)] {
            let shape = AttnShape::new(q_heads, kv_heads, head_dim).unwrap();
            let mut runs = Vec::new();
            let mut slot = rng.gen_range(0..20u32);
            while slot < POOL as u32 - 60 {
                let tokens = rng.gen_range(1..50usize);
                runs.push(FillRun {
                    slot,
                    position: rng.gen_range(0..3_000_000u64),
                    tokens,
                });
                slot += tokens as u32 + rng.gen_range(0..30u32);
            }
            let seed = rng.gen();
            let (gk, gv) = filled(&gpu, &shape, dtype, seed, &runs).unwrap();
            let (ck, cv) = filled(&CpuBackend, &shape, dtype, seed, &runs).unwrap();
            // Every NaN is the poison (its payload widens differently on the two backends).
            let bits = |x: &[f32]| {
                x.iter()
                    .map(|v| if v.is_nan() { u32::MAX } else { v.to_bits() })
                    .collect::<Vec<_>>()
            };
            let first_difference = |g: &[f32], c: &[f32]| {
                let (g, c) = (bits(g), bits(c));
                (g.len() != c.len())
                    .then_some(0)
                    .or_else(|| g.iter().zip(&c).position(|(x, y)| x != y))
            };
            assert_eq!(first_difference(&gk, &ck), None, "{shape:?} {dtype:?}: K");
            assert_eq!(first_difference(&gv, &cv), None, "{shape:?} {dtype:?}: V");
            let width = shape.kv_token_elems();
            let written: usize = runs.iter().map(|r| r.tokens).sum();
            let finite = gk.iter().filter(|x| x.is_finite()).count();
            assert_eq!(
                finite,
                written * width,
                "{shape:?} {dtype:?}: slots written"
            );
            eprintln!(
                "{shape:?} {dtype:?}: {} runs, {written} of {POOL} slots, equal",
                runs.len()
            );
        }
    }
}
