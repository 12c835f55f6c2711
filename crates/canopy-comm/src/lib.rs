//! # canopy-comm
//!
//! Collectives between canopy ranks behind one trait, [`Collective`], whose calls mirror NCCL's
//! (all-reduce max/sum, reduce-scatter, all-gather, point-to-point send/recv, barrier) so that the engine's
//! strategies are written once and run over any transport.
//!
//! `MpiComm` (cargo feature `mpi`) is one rank per process under `mpirun` / `srun`, with the
//! same determinism: reductions gather every rank's bytes and fold them in rank order.
//!
//! [`ThreadWorld`] runs `p` ranks as threads of one process and exchanges host buffers through
//! shared memory. It is deterministic (reductions fold ranks in rank order, so every rank gets
//! bit-identical results) and never hangs: every wait has a timeout, and a rank that fails
//! aborts the world so that its peers return [`CommError::Aborted`] promptly.
//!
//! Traffic is counted per rank with the ring-algorithm formulas NCCL's bandwidth figures use
//! (all-reduce `2 (p-1)/p · n`, reduce-scatter and all-gather `(p-1)/p · n_total`, send `n`), so benchmarks report
//! the same "bytes communicated per rank" on every transport.

#[cfg(feature = "mpi")]
mod mpi_comm;
mod thread;

#[cfg(feature = "mpi")]
pub use mpi_comm::MpiComm;
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
    #[error("MPI: {0}")]
    Mpi(String),
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

impl Element for u64 {
    fn reduce(a: u64, b: u64, op: ReduceOp) -> u64 {
        match op {
            ReduceOp::Sum => a.wrapping_add(b),
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

/// Folds every rank's copy of a buffer (`chunks`, in rank order, as raw bytes) into `buf` with
/// `op`. Every rank folds the same bytes in the same order, so all get bit-identical results.
pub(crate) fn fold_rank_order<'a, T: Element>(
    buf: &mut [T],
    chunks: impl Iterator<Item = &'a [u8]>,
    op: ReduceOp,
) {
    for (r, bytes) in chunks.enumerate() {
        if r == 0 {
            bytemuck::cast_slice_mut::<T, u8>(buf).copy_from_slice(bytes);
        } else {
            // A rank's bytes need not be aligned for `T`: each element is read unaligned, in
            // place, with no copy of the buffer.
            let theirs = bytes
                .chunks_exact(std::mem::size_of::<T>())
                .map(bytemuck::pod_read_unaligned::<T>);
            buf.iter_mut()
                .zip(theirs)
                .for_each(|(a, b)| *a = T::reduce(*a, b, op));
        }
    }
}

/// Checks that `who` sent this rank the `want` bytes it expects in `op`.
pub(crate) fn check_bytes(
    rank: usize,
    op: &'static str,
    who: std::fmt::Arguments,
    got: usize,
    want: usize,
) -> Result<()> {
    if got != want {
        let detail = format!("{who} sent {got} bytes, expected {want}");
        return Err(CommError::SizeMismatch { rank, op, detail });
    }
    Ok(())
}

/// Checks that a reduce-scatter's buffer of `len` elements splits into `ranks` equal blocks.
pub(crate) fn check_blocks(rank: usize, len: usize, ranks: usize) -> Result<()> {
    if !len.is_multiple_of(ranks) {
        let detail = format!("{len} elements do not split into {ranks} equal blocks");
        return Err(CommError::SizeMismatch {
            rank,
            op: "reduce_scatter",
            detail,
        });
    }
    Ok(())
}

/// Checks that an all-gather's receive buffer holds `ranks` copies of the send buffer.
pub(crate) fn check_gather_len(rank: usize, send: usize, recv: usize, ranks: usize) -> Result<()> {
    if recv != send * ranks {
        let detail = format!("recv holds {recv} elements, needs {send} x {ranks}");
        return Err(CommError::SizeMismatch {
            rank,
            op: "all_gather",
            detail,
        });
    }
    Ok(())
}

/// Bytes one rank has communicated, by the ring-algorithm formulas (see the crate notes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Traffic {
    pub bytes: u64,
    pub calls: u64,
}

/// Collectives over host buffers between the ranks of one world.
/// A group of ranks this process takes part in: what every transport has, whatever it moves.
pub trait Group {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
}

pub trait Collective: Group {
    /// In place; every rank ends with the same, rank-order-folded result.
    fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()>;
    /// In place, on `size()` equal blocks of `buf`: rank `r`'s block `r` ends with the
    /// rank-order fold of every rank's block `r` (the bits [`Collective::all_reduce`] gives
    /// there); its other blocks are left as they were. Half an all-reduce's traffic, for ranks
    /// that each read only their own block.
    fn reduce_scatter<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()>;
    /// `recv` is `size() * send.len()` long; rank `r`'s data lands at `r * send.len()`.
    fn all_gather<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()>;
    fn send<T: Element>(&self, buf: &[T], peer: usize) -> Result<()>;
    /// Receives exactly `buf.len()` elements from `peer`.
    fn recv<T: Element>(&self, buf: &mut [T], peer: usize) -> Result<()>;
    fn barrier(&self) -> Result<()>;
    /// Traffic since the world started.
    fn traffic(&self) -> Traffic;
    /// The host this rank runs on; ranks with the same host share a node. Threads of one
    /// process all share one.
    fn host_name(&self) -> Result<String> {
        Ok("localhost".into())
    }
}

/// A rank handle whose host-side collectives are another [`Collective`]'s: a device transport
/// (streams of one GPU, NCCL) hands its host calls (host names, barriers, small host
/// reductions) to the collective its ranks were started with. It is a [`Collective`] by
/// forwarding, with its own traffic counted besides the host's.
pub trait HostPart: Group {
    type Host: Collective;
    fn host(&self) -> &Self::Host;
    /// Traffic of its own, besides the host's. Provided: none.
    fn own_traffic(&self) -> Traffic {
        Traffic::default()
    }
}

impl<T: HostPart> Collective for T {
    fn all_reduce<E: Element>(&self, buf: &mut [E], op: ReduceOp) -> Result<()> {
        self.host().all_reduce(buf, op)
    }

    fn reduce_scatter<E: Element>(&self, buf: &mut [E], op: ReduceOp) -> Result<()> {
        self.host().reduce_scatter(buf, op)
    }

    fn all_gather<E: Element>(&self, send: &[E], recv: &mut [E]) -> Result<()> {
        self.host().all_gather(send, recv)
    }

    fn send<E: Element>(&self, buf: &[E], peer: usize) -> Result<()> {
        self.host().send(buf, peer)
    }

    fn recv<E: Element>(&self, buf: &mut [E], peer: usize) -> Result<()> {
        self.host().recv(buf, peer)
    }

    fn barrier(&self) -> Result<()> {
        self.host().barrier()
    }

    fn traffic(&self) -> Traffic {
        let (host, own) = (self.host().traffic(), self.own_traffic());
        Traffic {
            bytes: host.bytes + own.bytes,
            calls: host.calls + own.calls,
        }
    }

    fn host_name(&self) -> Result<String> {
        self.host().host_name()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A handle that counts 1,000 bytes of its own on top of its host's.
    struct Counted(ThreadComm);

    impl Group for Counted {
        fn rank(&self) -> usize {
            self.0.rank()
        }

        fn size(&self) -> usize {
            self.0.size()
        }
    }

    impl HostPart for Counted {
        type Host = ThreadComm;
        fn host(&self) -> &ThreadComm {
            &self.0
        }

        fn own_traffic(&self) -> Traffic {
            Traffic {
                bytes: 1000,
                calls: 1,
            }
        }
    }

    /// The host's collectives answer through the handle, and traffic adds the handle's own.
    #[test]
    fn a_host_part_forwards_and_adds_its_traffic() {
        let out = ThreadWorld::run(3, Duration::from_secs(30), |comm| {
            let c = Counted(comm);
            let mut x = [c.rank() as f32 + 1.0];
            c.all_reduce(&mut x[..], ReduceOp::Sum)?;
            let host = c.host().traffic();
            Ok::<_, CommError>((x[0], host, c.traffic()))
        });
        for r in out {
            let (sum, host, all) = r.expect("the rank ran");
            assert_eq!(sum, 6.0);
            assert!(host.bytes > 0);
            assert_eq!(all.bytes, host.bytes + 1000);
            assert_eq!(all.calls, host.calls + 1);
        }
    }
}
