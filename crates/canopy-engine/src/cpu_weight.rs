//! The CPU backend's weights: f32 values, or a quantized model's codes
//! ([`canopy_core::coded`]), which products and embedding lookups decode as they read them.
//!
//! A decode step of one sequence reads every weight once and is bound by how fast it can:
//! SmolLM2's f32 weights are 650 MB a step, its codes 200 MB. The codes decode to the f32
//! values bit for bit, so both forms compute the same model.

use crate::cpu_layers::HostMatrix;
use crate::host_ops::{matmul, matmul_coded};
use crate::{EngineError, Result};
use canopy_core::CodedMatrix;

/// A weight in CPU memory.
#[derive(Debug, Clone, PartialEq)]
pub enum CpuWeight {
    /// Row-major f32 values.
    Dense(HostMatrix),
    /// A quantized model's weight, as the codes of its file.
    Coded(CodedMatrix),
}

impl CpuWeight {
    /// `(rows, cols)`.
    pub fn dims(&self) -> (usize, usize) {
        match self {
            CpuWeight::Dense(m) => (m.rows, m.cols),
            CpuWeight::Coded(m) => (m.rows, m.cols),
        }
    }

    /// The f32 values of a weight that `op` reads whole (a norm's weights, RoPE's
    /// frequencies), which a model stores unquantized.
    pub(crate) fn values(&self, op: &str) -> Result<&[f32]> {
        match self {
            CpuWeight::Dense(m) => Ok(&m.data),
            CpuWeight::Coded(m) => Err(EngineError::Backend {
                backend: "cpu",
                message: format!(
                    "{op}: its weight of {} × {} is quantized; upload it as f32 values",
                    m.rows, m.cols
                ),
            }),
        }
    }

    /// `out[x.rows × rows] = x · selfᵀ`, or `out +=` it when `accumulate`.
    pub(crate) fn product(&self, x: &HostMatrix, out: &mut [f32], accumulate: bool) {
        match self {
            CpuWeight::Dense(w) => matmul(&x.data, x.rows, &w.data, w.rows, out, accumulate),
            CpuWeight::Coded(w) => matmul_coded(&x.data, x.rows, w, out, accumulate),
        }
    }

    /// Row `row`'s values into `out` (`cols` long).
    pub(crate) fn copy_row(&self, row: usize, out: &mut [f32]) {
        match self {
            CpuWeight::Dense(m) => out.copy_from_slice(&m.data[row * m.cols..(row + 1) * m.cols]),
            CpuWeight::Coded(m) => m.decode_row(row, out),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A coded weight of `rows × cols` in groups of 16, with codes of every sign and offsets
    /// zero or not, and the same weight as f32 values.
    fn weights(rows: usize, cols: usize) -> (CpuWeight, CpuWeight) {
        let mut coded = CodedMatrix::zeros(rows, cols, 16).unwrap();
        for (i, c) in coded.codes.iter_mut().enumerate() {
            *c = ((i * 7919 + 13) % 255) as i8;
        }
        for (g, (step, offset)) in (coded.steps.iter_mut())
            .zip(coded.offsets.iter_mut())
            .enumerate()
        {
            *step = (g % 11) as f32 * 1e-3 + 1e-4;
            *offset = if g % 3 == 0 {
                -0.0
            } else {
                (g % 7) as f32 * 0.01 - 0.03
            };
        }
        let dense = HostMatrix {
            rows,
            cols,
            data: coded.to_f32(),
        };
        (CpuWeight::Coded(coded), CpuWeight::Dense(dense))
    }

    fn input(rows: usize, cols: usize) -> HostMatrix {
        let data = (0..rows * cols)
            .map(|i| ((i * 104_729 % 997) as f32 / 997.0 - 0.5) * 2.0)
            .collect();
        HostMatrix { rows, cols, data }
    }

    /// Coded products give the f32 weight's bits from 2 rows on (decode batches and prompts
    /// take the same arithmetic over the same values), and one row alone gives its bits in
    /// a batch; rows and lookups decode to the f32 rows.
    #[test]
    fn coded_weights_compute_what_their_values_do() {
        for (k, n, rows) in [(1536, 300, 64), (576, 960, 100)] {
            let (coded, dense) = weights(n, k);
            let x = input(rows, k);
            let (mut by_codes, mut by_values) = (vec![0.0; rows * n], vec![0.0; rows * n]);
            coded.product(&x, &mut by_codes, false);
            dense.product(&x, &mut by_values, false);
            let same = (by_codes.iter().zip(&by_values)).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{rows} rows of {k} by {n}");
        }
        let (k, n) = (96, 200);
        let (coded, dense) = weights(n, k);
        for rows in [1, 2, 3, 7, 32, 33, 40] {
            let x = input(rows, k);
            for accumulate in [false, true] {
                let start: Vec<f32> = (0..rows * n).map(|i| (i % 5) as f32).collect();
                let (mut by_codes, mut by_values) = (start.clone(), start.clone());
                coded.product(&x, &mut by_codes, accumulate);
                dense.product(&x, &mut by_values, accumulate);
                if rows == 1 {
                    let close = by_codes.iter().zip(&by_values);
                    assert!(close
                        .clone()
                        .all(|(a, b)| (a - b).abs() <= 1e-5 * b.abs().max(1.0)));
                    let mut batch = vec![0.0; 3 * n];
                    let three = input(3, k);
                    coded.product(&three, &mut batch, false);
                    let mut alone = vec![0.0; n];
                    coded.product(&input(1, k), &mut alone, false);
                    assert_eq!(alone, batch[..n], "row 0 alone and in a batch of 3");
                } else {
                    let same = by_codes
                        .iter()
                        .zip(&by_values)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{rows} rows, accumulate {accumulate}");
                }
            }
        }
        let (mut from_codes, mut from_values) = (vec![0.0; k], vec![1.0; k]);
        coded.copy_row(123, &mut from_codes);
        dense.copy_row(123, &mut from_values);
        assert_eq!(from_codes, from_values);
        assert!(coded.values("rms_norm").is_err());
        assert_eq!(dense.values("rms_norm").unwrap().len(), n * k);
    }
}
