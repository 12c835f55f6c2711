//! How the GPU tests that hold an op to the CPU's compare them: random inputs that are never
//! zero, outputs poisoned with NaN, and an error relative to the largest magnitude wanted.
//! Each test file uses some of them.
#![allow(dead_code)]

use canopy_engine::{LayerOps, Result};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

/// `n` values of magnitude in `[scale / 20, scale)`, of either sign: never zero.
pub fn values(rng: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let x = rng.gen_range(0.05f32..1.0) * scale;
            if rng.gen() {
                x
            } else {
                -x
            }
        })
        .collect()
}

pub fn poisoned<B: LayerOps>(b: &B, rows: usize, cols: usize) -> Result<B::Tensor> {
    b.upload_tensor(&vec![f32::NAN; rows * cols], rows, cols)
}

/// The largest difference between `got` and `want` over the largest finite magnitude of
/// `want`: 0 when equal, and infinite where one is NaN or infinite and the other differs (a NaN
/// is an element never written) or when the lengths differ.
pub fn error(got: &[f32], want: &[f32]) -> f64 {
    error_over(got, want, largest(want))
}

/// The largest finite magnitude of `x`.
fn largest(x: &[f32]) -> f64 {
    x.iter()
        .filter(|v| v.is_finite())
        .fold(0f64, |m, &v| m.max(f64::from(v).abs()))
}

/// The largest difference between `got` and `want` over `scale`, as [`error`].
fn error_over(got: &[f32], want: &[f32], scale: f64) -> f64 {
    if got.len() != want.len() {
        return f64::INFINITY;
    }
    let mut worst = 0f64;
    for (&g, &w) in got.iter().zip(want) {
        if g == w || (g.is_nan() && w.is_nan()) {
            continue;
        }
        if !(g.is_finite() && w.is_finite()) {
            return f64::INFINITY;
        }
        worst = worst.max((f64::from(g) - f64::from(w)).abs());
    }
    worst / scale.max(f64::MIN_POSITIVE)
}

/// Prints one comparison and fails above `tolerance`.
pub fn check(op: &str, got: &[f32], want: &[f32], tolerance: f64) {
    let e = error(got, want);
    eprintln!("  {op:<44} max error {e:.3e} (tolerance {tolerance:.0e})");
    assert!(e <= tolerance, "{op}: error {e:e} above {tolerance:e}");
}

/// Prints one comparison of SwiGLU outputs `silu(g) · u` and fails above `tolerance`: the error
/// is over the square of the largest magnitude of the gate|up `product` they were made from,
/// not over the outputs' own. A product off by ε of that magnitude moves an output by at most
/// about 2.1 ε of its square (|silu'| ≤ 1.1 and |silu(g)| ≤ |g|), whatever the outputs. Over
/// the outputs' own largest magnitude, a row whose gates are all negative (small outputs)
/// makes a 16-bit product's rounding look about ten times larger than the product's error.
pub fn check_swiglu(op: &str, got: &[f32], want: &[f32], product: &[f32], tolerance: f64) {
    let e = error_over(got, want, largest(product).powi(2));
    eprintln!("  {op:<44} max error {e:.3e} over the product's square (tolerance {tolerance:.0e})");
    assert!(e <= tolerance, "{op}: error {e:e} above {tolerance:e}");
}
