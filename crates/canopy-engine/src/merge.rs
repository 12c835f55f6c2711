//! Merging per-rank attention states across ranks (the Tree Attention reduction).
//!
//! Every form gives every rank the exact result; they differ in how many collectives they
//! issue, which is what costs at decode sizes (latency, not bandwidth):
//! - `allreduce3`: the paper's Algorithm 3: MAX of lse, then SUM of the numerator
//!   `o · exp(lse - max)` and SUM of the denominator `exp(lse - max)`.
//! - `allreduce2`: MAX, then one SUM of numerator and denominator packed together.
//! - `allgather`: one all-gather of `(o, lse)` and a local fold in rank order.

use crate::Result;
use canopy_comm::{Collective, ReduceOp};
use canopy_core::{merge_state, AttnStates, EMPTY_LSE};
use serde::Serialize;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum MergeCollective {
    Allreduce3,
    Allreduce2,
    Allgather,
}

impl MergeCollective {
    pub const ALL: [MergeCollective; 3] = [
        MergeCollective::Allreduce3,
        MergeCollective::Allreduce2,
        MergeCollective::Allgather,
    ];

    pub fn name(self) -> &'static str {
        match self {
            MergeCollective::Allreduce3 => "allreduce3",
            MergeCollective::Allreduce2 => "allreduce2",
            MergeCollective::Allgather => "allgather",
        }
    }

    /// Collective calls one merge issues.
    pub fn calls(self) -> usize {
        match self {
            MergeCollective::Allreduce3 => 3,
            MergeCollective::Allreduce2 => 2,
            MergeCollective::Allgather => 1,
        }
    }
}

impl std::str::FromStr for MergeCollective {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        MergeCollective::ALL
            .into_iter()
            .find(|c| c.name() == s)
            .ok_or_else(|| {
                format!("unknown collective `{s}`; use allreduce3, allreduce2 or allgather")
            })
    }
}

/// `exp(lse - max)`, with empty partials (and all-empty columns) weighing zero.
fn weight(lse: f32, max: f32) -> f32 {
    if lse == EMPTY_LSE {
        0.0
    } else {
        (lse - max).exp()
    }
}

/// Turns summed numerator and denominator back into a normalised state.
fn finish(s: &mut AttnStates, max: &[f32], num: &[f32], den: &[f32]) {
    let d = s.head_dim;
    for (i, (&m, &w)) in max.iter().zip(den).enumerate() {
        let o = &mut s.o[i * d..(i + 1) * d];
        if w > 0.0 {
            o.iter_mut()
                .zip(&num[i * d..(i + 1) * d])
                .for_each(|(o, &n)| *o = n / w);
            s.lse[i] = m + w.ln();
        } else {
            o.fill(0.0);
            s.lse[i] = EMPTY_LSE;
        }
    }
}

/// Replaces this rank's `states` with the merge of every rank's.
pub fn merge_across<C: Collective>(
    states: &mut AttnStates,
    comm: &C,
    how: MergeCollective,
) -> Result<()> {
    if comm.size() == 1 {
        return Ok(());
    }
    let d = states.head_dim;
    let cells = states.lse.len();
    match how {
        MergeCollective::Allreduce3 | MergeCollective::Allreduce2 => {
            let mut max = states.lse.clone();
            comm.all_reduce(&mut max, ReduceOp::Max)?;
            // Packed as [numerator (cells × d) | denominator (cells)].
            let mut packed = vec![0.0f32; cells * (d + 1)];
            let (num, den) = packed.split_at_mut(cells * d);
            for i in 0..cells {
                let w = weight(states.lse[i], max[i]);
                den[i] = w;
                num[i * d..(i + 1) * d]
                    .iter_mut()
                    .zip(&states.o[i * d..(i + 1) * d])
                    .for_each(|(n, &o)| *n = o * w);
            }
            if how == MergeCollective::Allreduce3 {
                comm.all_reduce(num, ReduceOp::Sum)?;
                comm.all_reduce(den, ReduceOp::Sum)?;
            } else {
                comm.all_reduce(&mut packed, ReduceOp::Sum)?;
            }
            let (num, den) = packed.split_at(cells * d);
            finish(states, &max, num, den);
        }
        MergeCollective::Allgather => {
            let mut mine = states.o.clone();
            mine.extend_from_slice(&states.lse);
            let mut all = vec![0.0f32; mine.len() * comm.size()];
            comm.all_gather(&mine, &mut all)?;
            let mut acc = AttnStates::empty(states.rows, states.heads, d);
            for chunk in all.chunks(mine.len()) {
                let (o, lse) = chunk.split_at(cells * d);
                for i in 0..cells {
                    merge_state(
                        &mut acc.o[i * d..(i + 1) * d],
                        &mut acc.lse[i],
                        &o[i * d..(i + 1) * d],
                        lse[i],
                    );
                }
            }
            *states = acc;
        }
    }
    Ok(())
}
