//! Products run the way a timing chose (`LayerOps::tune_products`): each is held to an f64
//! reference (or, for SwiGLU's 16-bit product, to the CPU backend), and a second backend that
//! adopts the first one's choices computes the same bits, as a server's ranks must.
//!
//! The shapes include the 8B model's output projection at 36 rows, where cuBLASLt offered an
//! algorithm about a fifth faster than `cublasGemmEx`'s pick on an H200 (BENCHMARKS, session
//! 65), so that the cuBLASLt path most likely runs; the test prints which way each ran.
//!
//! Without a GPU every test prints why and passes. The seed is printed; `CANOPY_TEST_SEED`
//! repeats a run.

mod common;
mod compare;
use common::{gpu, rng};
use compare::{check, poisoned, values};

use canopy_core::{DType, TypedVec};
use canopy_engine::{CpuBackend, LayerOps, Result};

/// One product: `rows` rows of `k` against an `n × k` weight.
#[derive(Debug, Clone, Copy)]
struct Case {
    op: &'static str,
    rows: usize,
    n: usize,
    k: usize,
}

const CASES: [Case; 4] = [
    Case {
        op: "matmul_add",
        rows: 36,
        n: 4096,
        k: 4096,
    },
    Case {
        op: "matmul",
        rows: 20,
        n: 3072,
        k: 1024,
    },
    Case {
        op: "matmul_add",
        rows: 100,
        n: 1024,
        k: 2048,
    },
    // SwiGLU's halves of 1,024 columns, the product held in the weight's dtype.
    Case {
        op: "matmul_swiglu",
        rows: 50,
        n: 2048,
        k: 1024,
    },
];

/// A case's inputs: the activation, the weight (rounded to its dtype) and the accumulator.
struct Inputs {
    x: Vec<f32>,
    w: Vec<f32>,
    acc: Vec<f32>,
}

/// `case`'s op on `b`, its output poisoned first.
fn run<B: LayerOps>(b: &B, dtype: DType, case: Case, inp: &Inputs) -> Result<Vec<f32>> {
    let w = b.upload_weight(&TypedVec::from_f32(dtype, &inp.w), case.n, case.k)?;
    let x = b.upload_tensor(&inp.x, case.rows, case.k)?;
    let out = match case.op {
        "matmul" => {
            let mut out = poisoned(b, case.rows, case.n)?;
            b.matmul(&x, &w, &mut out)?;
            out
        }
        "matmul_add" => {
            let mut out = b.upload_tensor(&inp.acc, case.rows, case.n)?;
            b.matmul_add(&x, &w, &mut out)?;
            out
        }
        _ => {
            let mut out = poisoned(b, case.rows, case.n / 2)?;
            b.matmul_swiglu(&x, &w, &mut out)?;
            out
        }
    };
    b.download_tensor(&out)
}

/// `x · wᵀ` (+ `acc`) in f64, `x` rounded to `dtype` as the GPU's GEMM takes it.
fn reference(dtype: DType, case: Case, inp: &Inputs) -> Vec<f32> {
    let mut out = Vec::with_capacity(case.rows * case.n);
    for r in 0..case.rows {
        let x = &inp.x[r * case.k..(r + 1) * case.k];
        for j in 0..case.n {
            let w = &inp.w[j * case.k..(j + 1) * case.k];
            let dot: f64 = (x.iter().zip(w))
                .map(|(&a, &b)| f64::from(dtype.round(a)) * f64::from(b))
                .sum();
            let acc = match case.op {
                "matmul_add" => f64::from(inp.acc[r * case.n + j]),
                _ => 0.0,
            };
            out.push((dot + acc) as f32);
        }
    }
    out
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

#[test]
fn tuned_products_are_right_and_adopted_choices_give_the_same_bits() {
    let test = "tuned_products_are_right_and_adopted_choices_give_the_same_bits";
    let (Some(timed), Some(adopting)) = (gpu(test), gpu(test)) else {
        return;
    };
    let mut rng = rng(test);
    for dtype in [DType::Bf16, DType::F16] {
        let inputs: Vec<Inputs> = CASES
            .iter()
            .map(|c| Inputs {
                x: values(&mut rng, c.rows * c.k, 2.0),
                w: (values(&mut rng, c.n * c.k, 0.2).into_iter())
                    .map(|v| dtype.round(v))
                    .collect(),
                acc: values(&mut rng, c.rows * c.n, 8.0),
            })
            .collect();
        timed.tune_products(true).unwrap();
        let tuned: Vec<Vec<f32>> = (CASES.iter().zip(&inputs))
            .map(|(&c, inp)| run(&timed, dtype, c, inp).unwrap())
            .collect();
        timed.tune_products(false).unwrap();
        let choices = timed.product_choices().unwrap();
        adopting.adopt_product_choices(&choices).unwrap();
        let listed = String::from_utf8_lossy(&choices);
        eprintln!(
            "{dtype}: {} shapes chosen, {} of them cuBLASLt's",
            listed.matches("\"shape\"").count(),
            listed.matches("\"algo\":[").count()
        );
        for ((&case, inp), got) in CASES.iter().zip(&inputs).zip(&tuned) {
            eprintln!("{dtype}, {case:?}:");
            match case.op {
                "matmul_swiglu" => {
                    let want = run(&CpuBackend, dtype, case, inp).unwrap();
                    check("tuned vs cpu", got, &want, 1e-2);
                }
                _ => check("tuned vs f64", got, &reference(dtype, case, inp), 1e-5),
            }
            let again = run(&timed, dtype, case, inp).unwrap();
            assert!(
                same_bits(got, &again),
                "{case:?}: a chosen product's bits moved"
            );
            let adopted = run(&adopting, dtype, case, inp).unwrap();
            assert!(
                same_bits(got, &adopted),
                "{case:?}: the adopting backend computed other bits"
            );
        }
    }
}

/// Choices that do not parse are refused with a message, not run.
#[test]
fn garbled_choices_are_refused() {
    let Some(b) = gpu("garbled_choices_are_refused") else {
        return;
    };
    let err = b.adopt_product_choices(b"not choices").unwrap_err();
    assert!(err.to_string().contains("garbled"), "{err}");
}
