//! What the merge tests share: random per-rank states (never zero, some cells empty) and
//! the f64 merge of every rank's, and the checks of merged states against another path, the
//! oracle and the other ranks.

use canopy_core::AttnStates;
use canopy_cuda::{CudaBackend, CudaStates};
use canopy_engine::{MergeOps, Result};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

/// The largest difference between `got` and `want` over the largest finite magnitude of
/// `want`; infinite where the lengths differ or one is NaN or infinite and the other differs.
pub fn error(got: &[f32], want: &[f32]) -> f64 {
    if got.len() != want.len() {
        return f64::INFINITY;
    }
    let scale = want
        .iter()
        .filter(|w| w.is_finite())
        .fold(0f64, |m, &w| m.max(f64::from(w).abs()))
        .max(f64::MIN_POSITIVE);
    let mut worst = 0f64;
    for (&g, &w) in got.iter().zip(want) {
        if g == w {
            continue;
        }
        if !g.is_finite() || !w.is_finite() {
            return f64::INFINITY;
        }
        worst = worst.max((f64::from(g) - f64::from(w)).abs() / scale);
    }
    worst
}

/// Rows `rows` of `s`.
pub fn rows_of(s: &AttnStates, rows: std::ops::Range<usize>) -> AttnStates {
    let cells = rows.start * s.heads..rows.end * s.heads;
    AttnStates {
        rows: rows.len(),
        heads: s.heads,
        head_dim: s.head_dim,
        o: s.o[cells.start * s.head_dim..cells.end * s.head_dim].to_vec(),
        lse: s.lse[cells].to_vec(),
    }
}

pub fn bits(s: &AttnStates) -> Vec<u32> {
    s.o.iter().chain(&s.lse).map(|x| x.to_bits()).collect()
}

/// Every rank's states the same bits as rank 0's.
pub fn assert_ranks_agree(what: &str, ranks: &[AttnStates]) {
    for (r, s) in ranks.iter().enumerate() {
        assert!(
            bits(s) == bits(&ranks[0]),
            "{what}: rank {r} differs from rank 0"
        );
    }
}

/// `got` within 1e-6 of `want` (o and lse), with the difference printed.
pub fn assert_close(what: &str, got: &AttnStates, want: &AttnStates) {
    let (eo, el) = (error(&got.o, &want.o), error(&got.lse, &want.lse));
    let same = bits(got) == bits(want);
    eprintln!(
        "  {what:<44} o {eo:.1e}  lse {el:.1e}{}",
        if same { "  (bit for bit)" } else { "" }
    );
    assert!(
        eo <= 1e-6 && el <= 1e-6,
        "{what}: o differs by {eo:e}, lse by {el:e}"
    );
    assert!(
        got.o.iter().chain(&got.lse).all(|x| !x.is_nan()),
        "{what}: NaN in the output"
    );
}

/// One rank's random states: `(o, lse)` per cell, never zero; a cell is empty (lse = -inf,
/// o = 0) on every rank where `empty_everywhere`, else on this rank with probability 1/5.
pub fn random_states(
    rng: &mut ChaCha8Rng,
    cells: usize,
    d: usize,
    empty_everywhere: &[bool],
) -> (Vec<f32>, Vec<f32>) {
    let mut o = Vec::with_capacity(cells * d);
    let mut lse = Vec::with_capacity(cells);
    for &all_empty in empty_everywhere.iter().take(cells) {
        if all_empty || rng.gen_bool(0.2) {
            o.extend(std::iter::repeat_n(0.0, d));
            lse.push(f32::NEG_INFINITY);
        } else {
            o.extend((0..d).map(|_| {
                let x = rng.gen_range(0.05f32..1.0);
                if rng.gen() {
                    x
                } else {
                    -x
                }
            }));
            lse.push(rng.gen_range(-6.0f32..6.0));
        }
    }
    (o, lse)
}

/// The f64 merge of every rank's states, cell by cell: the oracle of both transports.
pub fn reference_merge(inputs: &[(Vec<f32>, Vec<f32>)], cells: usize, d: usize) -> AttnStates {
    let (mut o, mut lse) = (vec![0f32; cells * d], vec![f32::NEG_INFINITY; cells]);
    for c in 0..cells {
        let m = inputs
            .iter()
            .map(|s| f64::from(s.1[c]))
            .fold(f64::NEG_INFINITY, f64::max);
        if m == f64::NEG_INFINITY {
            continue;
        }
        let w: Vec<f64> = inputs
            .iter()
            .map(|s| (f64::from(s.1[c]) - m).exp())
            .collect();
        let den: f64 = w.iter().sum();
        for i in 0..d {
            let num: f64 = inputs
                .iter()
                .zip(&w)
                .map(|(s, w)| f64::from(s.0[c * d + i]) * w)
                .sum();
            o[c * d + i] = (num / den) as f32;
        }
        lse[c] = (m + den.ln()) as f32;
    }
    AttnStates {
        rows: cells,
        heads: 1,
        head_dim: d,
        o,
        lse,
    }
}

/// `s` made on the device from one rank's `(o, lse)`: its packed state, folded alone, is itself.
pub fn states_from_host(
    b: &CudaBackend,
    input: &(Vec<f32>, Vec<f32>),
    s: &mut CudaStates,
) -> Result<()> {
    let (o, lse) = input;
    let mut packed = b.alloc_buf(o.len() + lse.len())?;
    b.buf_from_host(o, &mut packed, 0)?;
    b.buf_from_host(lse, &mut packed, o.len())?;
    b.combine_gathered(&packed, 1, s)
}
