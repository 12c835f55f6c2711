//! Merging per-rank attention states across ranks (the Tree Attention reduction).
//!
//! Every form gives every rank the exact result; they differ in how many collectives they
//! issue, which is what costs at decode sizes (latency, not bandwidth):
//! - `allreduce3`: the paper's Algorithm 3: MAX of lse, then SUM of the numerator
//!   `o · exp(lse - max)` and SUM of the denominator `exp(lse - max)`.
//! - `allreduce2`: MAX, then one SUM of numerator and denominator packed together.
//! - `allgather`: one all-gather of `(o, lse)` and a local fold in rank order.
//! - `hierarchical`: fold inside each node, exchange among node leaders only, then hand the
//!   result back inside each node (see [`crate::topology`]).
//! - `auto`: one of the above, chosen per run by the calibrated [`crate::cost::CostModel`].

use crate::topology::NodeLayout;
use crate::{EngineError, Result};
use canopy_comm::{Collective, ReduceOp};
use canopy_core::{merge_state, AttnStates, EMPTY_LSE};
use serde::Serialize;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum MergeCollective {
    Allreduce3,
    Allreduce2,
    Allgather,
    Hierarchical,
    Auto,
}

impl MergeCollective {
    /// Every choice a user can name.
    pub const ALL: [MergeCollective; 5] = [
        MergeCollective::Allreduce3,
        MergeCollective::Allreduce2,
        MergeCollective::Allgather,
        MergeCollective::Hierarchical,
        MergeCollective::Auto,
    ];

    /// The forms that actually move data (`auto` picks one of them).
    pub const CONCRETE: [MergeCollective; 4] = [
        MergeCollective::Allreduce2,
        MergeCollective::Allreduce3,
        MergeCollective::Allgather,
        MergeCollective::Hierarchical,
    ];

    pub fn name(self) -> &'static str {
        match self {
            MergeCollective::Allreduce3 => "allreduce3",
            MergeCollective::Allreduce2 => "allreduce2",
            MergeCollective::Allgather => "allgather",
            MergeCollective::Hierarchical => "hierarchical",
            MergeCollective::Auto => "auto",
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
                format!("unknown collective `{s}`; use allreduce3, allreduce2, allgather, hierarchical or auto")
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

/// Replaces this rank's `states` with the merge of every rank's. `how` must be concrete
/// (`auto` is resolved first, by [`crate::cost::CostModel::choose`]); `layout` places ranks on
/// nodes for the hierarchical form.
pub fn merge_across<C: Collective>(
    states: &mut AttnStates,
    comm: &C,
    how: MergeCollective,
    layout: &NodeLayout,
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
        MergeCollective::Hierarchical => {
            layout.check(comm.size())?;
            merge_hierarchical(states, comm, layout)?;
        }
        MergeCollective::Auto => {
            return Err(EngineError::Config(
                "the auto collective must be resolved to a concrete one before merging".into(),
            ))
        }
    }
    Ok(())
}

/// `o` then `lse`, as one message.
fn pack(s: &AttnStates) -> Vec<f32> {
    let mut v = s.o.clone();
    v.extend_from_slice(&s.lse);
    v
}

/// Receives a packed state from `peer` into the shape of `like`.
fn recv_states<C: Collective>(comm: &C, like: &AttnStates, peer: usize) -> Result<AttnStates> {
    let mut buf = vec![0.0f32; like.o.len() + like.lse.len()];
    comm.recv(&mut buf, peer)?;
    let mut s = like.clone();
    let (o, lse) = buf.split_at(like.o.len());
    s.o.copy_from_slice(o);
    s.lse.copy_from_slice(lse);
    Ok(s)
}

/// Members send to their node's leader, which folds them in rank order; leaders exchange
/// node states and fold them in node order (so every leader gets the same bits); leaders send
/// the result back to their members.
fn merge_hierarchical<C: Collective>(
    states: &mut AttnStates,
    comm: &C,
    layout: &NodeLayout,
) -> Result<()> {
    let me = comm.rank();
    let members = layout.members(layout.node_of(me));
    let leader = members[0];
    if me != leader {
        comm.send(&pack(states), leader)?;
        *states = recv_states(comm, states, leader)?;
        return Ok(());
    }
    let mut node = states.clone();
    for &m in &members[1..] {
        node.merge_from(&recv_states(comm, states, m)?);
    }
    let leaders = layout.leaders();
    let mut total = node.clone();
    if leaders.len() > 1 {
        let mine = pack(&node);
        for &l in leaders.iter().filter(|&&l| l != me) {
            comm.send(&mine, l)?;
        }
        total = AttnStates::empty(states.rows, states.heads, states.head_dim);
        for &l in &leaders {
            if l == me {
                total.merge_from(&node);
            } else {
                total.merge_from(&recv_states(comm, states, l)?);
            }
        }
    }
    let out = pack(&total);
    for &m in &members[1..] {
        comm.send(&out, m)?;
    }
    *states = total;
    Ok(())
}
