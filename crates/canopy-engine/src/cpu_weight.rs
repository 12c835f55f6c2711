//! The CPU backend's weights: f32 values, or a quantized model's codes
//! ([`canopy_core::coded`]), which products and embedding lookups decode as they read them.
//!
//! A decode step of one sequence reads every weight once and is bound by how fast it can:
//! SmolLM2's f32 weights are 538 MB a step; its codes, with their steps and offsets, 115 MB
//! (its 4-bit layers' codes stored two to a byte; 168 MB at a byte each). The codes decode to
//! the f32 values bit for bit, so both forms compute the same model; their products sum in
//! different orders (`host_ops::coded_rows` against `few_rows` and `gemm`), so results agree
//! to rounding.

use crate::cpu_layers::HostMatrix;
use crate::host_ops::{matmul, matmul_coded, CodedPanels};
use crate::{EngineError, Result};

/// A weight in CPU memory.
#[derive(Debug, Clone, PartialEq)]
pub enum CpuWeight {
    /// Row-major f32 values.
    Dense(HostMatrix),
    /// A quantized model's weight, as the codes of its file, in panels for the products.
    Coded(CodedPanels),
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
    use canopy_core::CodedMatrix;

    /// A coded weight of `rows × cols` in groups of 16, with `spread` distinct codes (of
    /// every sign at 255; 0..16, stored two to a byte, at 16) and offsets zero or not, and the
    /// same weight as f32 values.
    fn weights(rows: usize, cols: usize, spread: usize) -> (CpuWeight, CpuWeight) {
        let mut coded = CodedMatrix::zeros(rows, cols, 16).unwrap();
        for (i, c) in coded.codes.iter_mut().enumerate() {
            *c = ((i * 7919 + 13) % spread) as i8;
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
        (
            CpuWeight::Coded(CodedPanels::pack(&coded)),
            CpuWeight::Dense(dense),
        )
    }

    fn input(rows: usize, cols: usize) -> HostMatrix {
        let data = (0..rows * cols)
            .map(|i| ((i * 104_729 % 997) as f32 / 997.0 - 0.5) * 2.0)
            .collect();
        HostMatrix { rows, cols, data }
    }

    /// Coded products equal the f64 products of their values, added or not, on every path
    /// (converted as read, in blocks, and a prompt's panels through `gemm`), for weights whose
    /// rows fill their last panel or not and whose codes take a byte or a nibble; a row gives
    /// the same bits alone as in any batch of up to 32; rows and lookups decode to the f32
    /// rows.
    #[test]
    fn coded_weights_compute_what_their_values_do() {
        let shapes = [(96, 200), (64, 37), (576, 300)];
        for ((k, n), spread) in shapes.into_iter().flat_map(|s| [(s, 255), (s, 16)]) {
            let (coded, dense) = weights(n, k, spread);
            let panel_bytes = |w: &CpuWeight| match w {
                CpuWeight::Coded(panels) => panels.bytes(),
                CpuWeight::Dense(_) => unreachable!(),
            };
            let codes_saved = panel_bytes(&weights(n, k, 255).0) - panel_bytes(&coded);
            assert_eq!(
                codes_saved,
                if spread == 16 {
                    n.next_multiple_of(8) * k / 2
                } else {
                    0
                }
            );
            let CpuWeight::Dense(values) = &dense else {
                unreachable!()
            };
            for rows in [1, 2, 3, 4, 5, 7, 32, 33, 100] {
                let x = input(rows, k);
                let start: Vec<f32> = (0..rows * n).map(|i| (i % 5) as f32).collect();
                let mut alone_rows = vec![0.0; rows * n];
                coded.product(&x, &mut alone_rows, false);
                for accumulate in [false, true] {
                    let mut by_codes = start.clone();
                    coded.product(&x, &mut by_codes, accumulate);
                    for (r, c) in (0..rows).flat_map(|r| (0..n).map(move |c| (r, c))) {
                        let terms = (0..k)
                            .map(|i| x.data[r * k + i] as f64 * values.data[c * k + i] as f64);
                        let added = if accumulate {
                            start[r * n + c] as f64
                        } else {
                            0.0
                        };
                        let want = terms.clone().sum::<f64>() + added;
                        let scale = terms.map(f64::abs).sum::<f64>() + added;
                        let got = by_codes[r * n + c] as f64;
                        assert!(
                            (got - want).abs() <= 2e-6 * scale.max(1.0),
                            "{rows} rows of {k} by {n}, accumulate {accumulate}: ({r}, {c}) \
                             {got} against {want}"
                        );
                    }
                }
                if rows <= 32 {
                    for r in [0, rows - 1] {
                        let one = HostMatrix {
                            rows: 1,
                            cols: k,
                            data: x.data[r * k..(r + 1) * k].to_vec(),
                        };
                        let mut alone = vec![0.0; n];
                        coded.product(&one, &mut alone, false);
                        let batch = &alone_rows[r * n..(r + 1) * n];
                        let same = alone
                            .iter()
                            .zip(batch)
                            .all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(
                            same,
                            "row {r} alone and in a batch of {rows}, {k} by {n}, {spread} codes"
                        );
                    }
                }
            }
        }
        let (k, n) = (96, 200);
        let (coded, dense) = weights(n, k, 255);
        let (mut from_codes, mut from_values) = (vec![0.0; k], vec![1.0; k]);
        coded.copy_row(123, &mut from_codes);
        dense.copy_row(123, &mut from_values);
        assert_eq!(from_codes, from_values);
        assert!(coded.values("rms_norm").is_err());
        assert_eq!(dense.values("rms_norm").unwrap().len(), n * k);
    }
}
