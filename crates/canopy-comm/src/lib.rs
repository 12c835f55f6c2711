//! # canopy-comm
//!
//! Collectives between canopy ranks behind one trait, [`Collective`], whose calls mirror NCCL's
//! (all-reduce max/sum, all-gather, point-to-point send/recv, barrier) so that the engine's
//! strategies are written once and run over any transport.
//!
//! [`ThreadWorld`] runs `p` ranks as threads of one process and exchanges host buffers through
//! shared memory. It is deterministic (reductions fold ranks in rank order, so every rank gets
//! bit-identical results) and never hangs: every wait has a timeout, and a rank that fails
//! aborts the world so that its peers return [`CommError::Aborted`] promptly.
//!
//! Traffic is counted per rank with the ring-algorithm formulas NCCL's bandwidth figures use
//! (all-reduce `2 (p-1)/p · n`, all-gather `(p-1)/p · n_total`, send `n`), so benchmarks report
//! the same "bytes communicated per rank" on every transport.

mod thread;

pub use thread::{ThreadComm, ThreadWorld};

use thiserror::Error;

#[derive(Debug, Error, Clone, PartialEq)]
pub enum CommError {
    #[error("rank {rank}: {op} timed out after {secs:.1} s waiting for its peers; a peer may have died or hung (raise --timeout if the work is just slow)")]
    Timeout {
        rank: usize,
        op: &'static str,
        secs: f64,
    },
    #[error("rank {rank}: {op} aborted because rank {by} failed: {reason}")]
    Aborted {
        rank: usize,
        op: &'static str,
        by: usize,
        reason: String,
    },
    #[error("rank {rank}: {op} got buffers of different sizes ({detail})")]
    SizeMismatch {
        rank: usize,
        op: &'static str,
        detail: String,
    },
    #[error("rank {rank}: peer {peer} is out of range for a world of {size} ranks")]
    BadPeer {
        rank: usize,
        peer: usize,
        size: usize,
    },
}

pub type Result<T, E = CommError> = std::result::Result<T, E>;

/// Reduction operators of [`Collective::all_reduce`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    Max,
}

/// An element that can travel and be reduced.
pub trait Element: bytemuck::Pod + Send + Sync + 'static {
    fn reduce(a: Self, b: Self, op: ReduceOp) -> Self;
}

impl Element for f32 {
    fn reduce(a: f32, b: f32, op: ReduceOp) -> f32 {
        match op {
            ReduceOp::Sum => a + b,
            ReduceOp::Max => a.max(b),
        }
    }
}

impl Element for u8 {
    fn reduce(a: u8, b: u8, op: ReduceOp) -> u8 {
        match op {
            ReduceOp::Sum => a.wrapping_add(b),
            ReduceOp::Max => a.max(b),
        }
    }
}

/// Bytes one rank has communicated, by the ring-algorithm formulas (see the crate notes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Traffic {
    pub bytes: u64,
    pub calls: u64,
}

/// Collectives over host buffers between the ranks of one world.
pub trait Collective {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// In place; every rank ends with the same, rank-order-folded result.
    fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()>;
    /// `recv` is `size() * send.len()` long; rank `r`'s data lands at `r * send.len()`.
    fn all_gather<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()>;
    fn send<T: Element>(&self, buf: &[T], peer: usize) -> Result<()>;
    /// Receives exactly `buf.len()` elements from `peer`.
    fn recv<T: Element>(&self, buf: &mut [T], peer: usize) -> Result<()>;
    fn barrier(&self) -> Result<()>;
    /// Traffic since the world started.
    fn traffic(&self) -> Traffic;
}
