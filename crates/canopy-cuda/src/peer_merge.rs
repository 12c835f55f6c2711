//! The tree's all-gather merge as one kernel, where every rank's GPU maps every other rank's
//! memory (GPUs of one node over NVLink or PCIe peer access).
//!
//! A decode step merges a few kilobytes of states per layer, so the merge costs latency, not
//! bandwidth. Through NCCL it is three launches on the stream (the states packed, NCCL's
//! all-gather, the fold), each waiting for the one before. Here one kernel does it
//! (`peer_merge` in `combine.cu`): each CTA writes its cells of the states into every rank's
//! memory, raises a flag there, waits for every rank's flag in its own memory and folds the
//! ranks' states in rank order, with the arithmetic of the fold after NCCL's all-gather, so the
//! two paths give the same bits.
//!
//! The merge memory is allocated on every rank at the first merge (and again, larger, at the
//! first merge of larger states) and mapped by every peer ([`PeerMemory`]). Setting up is
//! collective, and every rank agrees whether the peer path runs: where one rank cannot map a
//! peer, or `CANOPY_PEER_MERGE=off` is set on any rank, every rank merges through NCCL
//! instead, so the world never splits between two protocols.

use crate::backend::{CudaBackend, CudaStates};
use crate::error::{DriverContext, Result};
use crate::peer_memory::{PeerMemory, PeerState};
use canopy_comm::Collective;
use canopy_kernels::Kernel;
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use std::cell::{Cell, RefCell};
use std::time::Duration;

/// Set to `off` (on any rank) to merge through NCCL's all-gather instead, for comparison.
pub const PEER_MERGE_SWITCH: &str = "CANOPY_PEER_MERGE";

/// Threads of a CTA of `peer_merge`: a warp per cell.
const THREADS: u32 = 256;
/// The most CTAs of one merge, and the flags each rank has. A CTA waits for its namesakes on
/// the other GPUs, so a grid must be resident at once on every GPU: 64 CTAs of 256 threads
/// are, on any GPU canopy runs.
const MAX_CTAS: usize = 64;
/// The most ranks the flags hold.
const MAX_RANKS: usize = 16;
/// The largest packed state (bytes) a rank's slot holds. Larger merges (a prefill's thousands
/// of rows, whose all-gather is bandwidth, not latency) go through NCCL.
const MAX_STATE_BYTES: usize = 8 << 20;
/// Bytes before the slots: every rank's flags, one per CTA.
const FLAGS_BYTES: usize = MAX_RANKS * MAX_CTAS * 4;

/// One rank's NCCL world's peer merge: not tried yet, off for the world, or set up with
/// memory for the largest states merged so far.
pub(crate) struct PeerMerge {
    timeout_ns: u64,
    state: RefCell<PeerState<Buffers>>,
    /// Bytes this rank has written into its peers' memory: an all-gather's, `(p - 1)` copies
    /// of its packed state a merge, as the traffic figures count one.
    sent: Cell<u64>,
}

/// The merge memory, mapped on every rank, and the calls' counters.
struct Buffers {
    /// Every rank's merge memory; kept for its drop and its size.
    memory: PeerMemory,
    /// Every rank's allocation as this GPU addresses it, in rank order.
    bases: CudaSlice<u64>,
    /// The last call's epoch, and the CTAs of the running call that have finished.
    counters: CudaSlice<u32>,
}

/// The grid of a merge of `cells` states: a warp a cell, at most [`MAX_CTAS`] CTAs.
fn ctas_for(cells: usize) -> u32 {
    let warps = (THREADS / 32) as usize;
    cells.div_ceil(warps).clamp(1, MAX_CTAS) as u32
}

/// Bytes of one rank's merge memory for `cells` states of `d`, over `ranks` ranks.
fn merge_bytes(cells: usize, d: usize, ranks: usize) -> usize {
    FLAGS_BYTES + 2 * ranks * cells * (d + 1) * 4
}

impl PeerMerge {
    pub(crate) fn new(timeout: Duration) -> PeerMerge {
        PeerMerge {
            timeout_ns: timeout.as_nanos().min(u64::MAX as u128) as u64,
            state: RefCell::new(PeerState::Untried),
            sent: Cell::new(0),
        }
    }

    /// Merges `states` over every rank of `host`'s world in one kernel, setting the memory
    /// up on first use and again, larger, for states larger than any before. `Ok(false)`
    /// where the peer path does not run (agreed by every rank, as the call is collective):
    /// the caller merges through NCCL.
    pub(crate) fn merge<H: Collective>(
        &self,
        host: &H,
        b: &CudaBackend,
        s: &mut CudaStates,
    ) -> Result<bool> {
        let (cells, d) = (s.rows * s.heads, s.head_dim);
        if host.size() < 2 || host.size() > MAX_RANKS || cells * (d + 1) * 4 > MAX_STATE_BYTES {
            return Ok(false);
        }
        let mut state = self.state.borrow_mut();
        let bytes = merge_bytes(cells, d, host.size());
        let had = match &*state {
            PeerState::Off => return Ok(false),
            PeerState::On(x) => Some(x.memory.bytes),
            PeerState::Untried => None,
        };
        if had.is_none_or(|had| had < bytes) {
            // Every rank is here at the same call: the old memory's last merge has ended on
            // every rank once it has on this one (each waited for all the others' writes).
            b.stream().synchronize().ctx("cuStreamSynchronize")?;
            *state = PeerState::Untried;
            // Growing at least twofold keeps a batch that grows row by row to a few set-ups.
            let bytes = had.map_or(bytes, |had| bytes.max(2 * had));
            match self.set_up(host, b, bytes)? {
                Ok(x) => {
                    tracing::info!(
                        rank = host.rank(),
                        bytes,
                        "the tree's all-gather merge runs as one kernel over the peers' memory"
                    );
                    *state = PeerState::On(x)
                }
                Err(reason) => {
                    tracing::info!(rank = host.rank(), %reason, "the tree's all-gather merge goes through NCCL");
                    *state = PeerState::Off;
                    return Ok(false);
                }
            }
        }
        let PeerState::On(x) = &*state else {
            unreachable!("set up above")
        };
        self.launch(host.rank(), host.size(), b, x, s)?;
        Ok(true)
    }

    /// Whether the all-gather merge runs as one kernel over the peers' memory: `None` until
    /// the world's first all-gather merge has set it up or agreed it cannot.
    pub(crate) fn active(&self) -> Option<bool> {
        self.state.borrow().active()
    }

    /// Bytes this rank has written into its peers' memory.
    pub(crate) fn bytes_sent(&self) -> u64 {
        self.sent.get()
    }

    fn launch(
        &self,
        me: usize,
        ranks: usize,
        b: &CudaBackend,
        x: &Buffers,
        s: &mut CudaStates,
    ) -> Result<()> {
        let (me, ranks, flags_per_rank) = (me as u32, ranks as u32, MAX_CTAS as u32);
        let (cells, d) = ((s.rows * s.heads) as u32, s.head_dim as u32);
        let slots_at = FLAGS_BYTES as u64;
        let f = b.function(Kernel::Combine("peer_merge"))?;
        let mut l = b.stream().launch_builder(&f);
        l.arg(&x.bases)
            .arg(&me)
            .arg(&ranks)
            .arg(&flags_per_rank)
            .arg(&slots_at)
            .arg(&x.counters)
            .arg(&mut s.o)
            .arg(&mut s.lse)
            .arg(&cells)
            .arg(&d)
            .arg(&self.timeout_ns);
        let cfg = LaunchConfig {
            grid_dim: (ctas_for(cells as usize), 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: every base maps at least `merge_bytes(cells, d, ranks)` bytes on its rank
        // (checked by the caller): `ranks × MAX_CTAS` flags and two parities of `ranks`
        // packed states of `cells × (d + 1)` floats; `counters` holds two; the states hold
        // `cells` cells of `d`.
        unsafe { l.launch(cfg) }.ctx("launching peer_merge")?;
        let state_bytes = u64::from(cells) * (u64::from(d) + 1) * 4;
        self.sent
            .set(self.sent.get() + u64::from(ranks - 1) * state_bytes);
        Ok(())
    }

    /// Allocates `bytes` of merge memory on this rank and maps every peer's, together with
    /// every rank. The inner error is the agreed reason the peer path is off.
    fn set_up<H: Collective>(
        &self,
        host: &H,
        b: &CudaBackend,
        bytes: usize,
    ) -> Result<std::result::Result<Buffers, String>> {
        b.renew("the peer merge's memory")?;
        let willing = std::env::var(PEER_MERGE_SWITCH).map_or(true, |v| v != "off");
        let memory =
            match PeerMemory::map(host, b, bytes, (PEER_MERGE_SWITCH, willing), "merge memory")? {
                Ok(memory) => memory,
                Err(why) => return Ok(Err(why)),
            };
        Ok(Ok(Buffers {
            bases: b.upload(&memory.bases)?,
            counters: b.upload(&[0u32; 2])?,
            memory,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A warp a cell up to the grid's cap, and at least one CTA.
    #[test]
    fn the_grid_covers_the_cells_within_its_cap() {
        let warps = (THREADS / 32) as usize;
        assert_eq!(ctas_for(0), 1);
        assert_eq!(ctas_for(1), 1);
        assert_eq!(ctas_for(32), 32usize.div_ceil(warps) as u32);
        assert_eq!(ctas_for(MAX_CTAS * warps + 1), MAX_CTAS as u32);
        assert!(merge_bytes(32, 128, 2) >= FLAGS_BYTES + 2 * 2 * 32 * 129 * 4);
    }
}
