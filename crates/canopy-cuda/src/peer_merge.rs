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
//! first merge of larger states) and mapped by every peer: ranks that are threads of one process address each other's allocations directly once
//! peer access is enabled between their GPUs' contexts; ranks in other processes of the same
//! host open them by CUDA IPC handles. Setting up is collective (the handles travel over the
//! host collective the ranks were started with), and every rank agrees whether the peer path
//! runs: where one rank cannot map a peer, or `CANOPY_PEER_MERGE=off` is set on any rank, every
//! rank merges through NCCL instead, so the world never splits between two protocols.

use crate::backend::{CudaBackend, CudaStates};
use crate::error::{CudaError, DriverContext, Result};
use canopy_comm::{Collective, ReduceOp};
use canopy_kernels::Kernel;
use cudarc::driver::sys::{self, CUdeviceptr};
use cudarc::driver::{result, CudaContext, CudaSlice, LaunchConfig, PushKernelArg};
use std::cell::{Cell, RefCell};
use std::hash::{Hash, Hasher};
use std::sync::Arc;
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

/// Words one rank tells the others when merge memory is set up (`Record`).
const RECORD_WORDS: usize = 14;

/// One rank's NCCL world's peer merge: not tried yet, off for the world, or set up with
/// memory for the largest states merged so far.
pub(crate) struct PeerMerge {
    timeout_ns: u64,
    state: RefCell<State>,
    /// Bytes this rank has written into its peers' memory: an all-gather's, `(p - 1)` copies
    /// of its packed state a merge, as the traffic figures count one.
    sent: Cell<u64>,
}

enum State {
    Untried,
    /// Every rank agreed the peer path does not run.
    Off,
    On(Buffers),
}

/// What a rank tells the others about one allocation of merge memory.
#[derive(Clone, Copy)]
struct Record {
    pid: u64,
    host: u64,
    ordinal: u64,
    /// 0 where this rank cannot take part (the switch is off, or the allocation failed).
    willing: u64,
    ptr: u64,
    /// The allocation's IPC handle, where the driver exported one.
    handle: Option<[u64; 8]>,
}

impl Record {
    fn words(&self) -> [u64; RECORD_WORDS] {
        let mut w = [0u64; RECORD_WORDS];
        w[..5].copy_from_slice(&[self.pid, self.host, self.ordinal, self.willing, self.ptr]);
        w[5] = self.handle.is_some() as u64;
        w[6..].copy_from_slice(&self.handle.unwrap_or_default());
        w
    }

    fn from_words(w: &[u64]) -> Record {
        Record {
            pid: w[0],
            host: w[1],
            ordinal: w[2],
            willing: w[3],
            ptr: w[4],
            handle: (w[5] != 0).then(|| std::array::from_fn(|i| w[6 + i])),
        }
    }
}

/// Merge memory this rank allocated and the peers' it opened, released on drop.
struct Mapping {
    context: Arc<CudaContext>,
    own: CUdeviceptr,
    /// Peers' allocations opened by IPC handle.
    opened: Vec<CUdeviceptr>,
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // Nothing to report to: a failure here leaves memory to the context's teardown.
        if self.context.bind_to_thread().is_ok() {
            for &p in &self.opened {
                // SAFETY: opened by cuIpcOpenMemHandle in this context, closed once.
                let _ = unsafe { sys::cuIpcCloseMemHandle(p) }.result();
            }
            // SAFETY: allocated by cuMemAlloc in this context, freed once.
            let _ = unsafe { result::free_sync(self.own) };
        }
    }
}

/// The merge memory, mapped on every rank, and the calls' counters.
struct Buffers {
    /// Bytes of each rank's allocation.
    bytes: usize,
    /// Kept for its drop: the memory `bases` names.
    _mapping: Mapping,
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

fn host_hash(name: &str) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    name.hash(&mut h);
    h.finish()
}

impl PeerMerge {
    pub(crate) fn new(timeout: Duration) -> PeerMerge {
        PeerMerge {
            timeout_ns: timeout.as_nanos().min(u64::MAX as u128) as u64,
            state: RefCell::new(State::Untried),
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
            State::Off => return Ok(false),
            State::On(x) => Some(x.bytes),
            State::Untried => None,
        };
        if had.is_none_or(|had| had < bytes) {
            // Every rank is here at the same call: the old memory's last merge has ended on
            // every rank once it has on this one (each waited for all the others' writes).
            b.stream().synchronize().ctx("cuStreamSynchronize")?;
            *state = State::Untried;
            // Growing at least twofold keeps a batch that grows row by row to a few set-ups.
            let bytes = had.map_or(bytes, |had| bytes.max(2 * had));
            match self.set_up(host, b, bytes)? {
                Ok(x) => {
                    tracing::info!(
                        rank = host.rank(),
                        bytes,
                        "the tree's all-gather merge runs as one kernel over the peers' memory"
                    );
                    *state = State::On(x)
                }
                Err(reason) => {
                    tracing::info!(rank = host.rank(), %reason, "the tree's all-gather merge goes through NCCL");
                    *state = State::Off;
                    return Ok(false);
                }
            }
        }
        let State::On(x) = &*state else {
            unreachable!("set up above")
        };
        self.launch(host.rank(), host.size(), b, x, s)?;
        Ok(true)
    }

    /// Whether the all-gather merge runs as one kernel over the peers' memory: `None` until
    /// the world's first all-gather merge has set it up or agreed it cannot.
    pub(crate) fn active(&self) -> Option<bool> {
        match &*self.state.borrow() {
            State::Untried => None,
            State::Off => Some(false),
            State::On(_) => Some(true),
        }
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
        let (me, ranks) = (host.rank(), host.size());
        let context = b.stream().context().clone();
        context.bind_to_thread().ctx("cuCtxSetCurrent")?;
        let switched_off = std::env::var(PEER_MERGE_SWITCH).is_ok_and(|v| v == "off");
        let own = if switched_off {
            None
        } else {
            allocate(bytes).ok()
        };
        let name = host.host_name().map_err(canopy_engine::EngineError::from)?;
        let mine = Record {
            pid: std::process::id() as u64,
            host: host_hash(&name),
            ordinal: b.gpu().ordinal as u64,
            willing: own.is_some() as u64,
            ptr: own.map_or(0, |(p, _)| p),
            handle: own.and_then(|(_, h)| h),
        };
        let mut words = vec![0u64; RECORD_WORDS * ranks];
        host.all_gather(&mine.words(), &mut words)
            .map_err(canopy_engine::EngineError::from)?;
        let all: Vec<Record> = words.chunks(RECORD_WORDS).map(Record::from_words).collect();
        let refusal = if let Some(r) = all.iter().position(|x| x.willing == 0) {
            Some(format!(
                "rank {r} has {PEER_MERGE_SWITCH}=off or could not allocate its merge memory"
            ))
        } else if all.iter().any(|x| x.host != all[0].host) {
            Some("the ranks are on more than one host".to_string())
        } else {
            None
        };
        let mut mapping = own.map(|(own, _)| Mapping {
            context: context.clone(),
            own,
            opened: Vec::new(),
        });
        if let Some(why) = refusal {
            return Ok(Err(why));
        }
        let m = mapping.as_mut().expect("every rank was willing");
        let mapped = map_peers(&all, me, m);
        let mut votes = [mapped.is_err() as u8];
        host.all_reduce(&mut votes[..], ReduceOp::Max)
            .map_err(canopy_engine::EngineError::from)?;
        let bases = match (mapped, votes[0]) {
            (Ok(bases), 0) => bases,
            (Err(e), _) => return Ok(Err(format!("rank {me} could not map a peer's memory: {e}"))),
            (Ok(_), _) => return Ok(Err("a rank could not map a peer's memory".to_string())),
        };
        Ok(Ok(Buffers {
            bytes,
            _mapping: mapping.expect("every rank was willing"),
            bases: b.upload(&bases)?,
            counters: b.upload(&[0u32; 2])?,
        }))
    }
}

/// `bytes` of zeroed device memory in the current context, and its IPC handle where the
/// driver exports one (ranks in other processes need it; threads of this one do not).
fn allocate(bytes: usize) -> Result<(CUdeviceptr, Option<[u64; 8]>)> {
    // SAFETY: a fresh allocation of `bytes`, zeroed before anyone can see it.
    let ptr = unsafe { result::malloc_sync(bytes) }.ctx("cuMemAlloc (peer merge)")?;
    // SAFETY: `ptr` holds `bytes` bytes.
    if let Err(e) = unsafe { result::memset_d8_sync(ptr, 0, bytes) } {
        // SAFETY: allocated above, freed once.
        let _ = unsafe { result::free_sync(ptr) };
        return Err(e).ctx("cuMemsetD8 (peer merge)");
    }
    let mut handle = sys::CUipcMemHandle { reserved: [0; 64] };
    // SAFETY: `ptr` is a cuMemAlloc allocation of this context; `handle` is written.
    let exported = unsafe { sys::cuIpcGetMemHandle(&mut handle, ptr) }
        .result()
        .is_ok();
    Ok((ptr, exported.then(|| handle_words(&handle))))
}

/// An IPC handle's 64 bytes as the words a [`Record`] carries.
fn handle_words(handle: &sys::CUipcMemHandle) -> [u64; 8] {
    std::array::from_fn(|i| {
        u64::from_ne_bytes(std::array::from_fn(|j| handle.reserved[8 * i + j] as u8))
    })
}

/// The IPC handle [`handle_words`] wrote.
fn handle_from_words(words: &[u64; 8]) -> sys::CUipcMemHandle {
    sys::CUipcMemHandle {
        reserved: std::array::from_fn(|i| words[i / 8].to_ne_bytes()[i % 8] as _),
    }
}

/// Every rank's allocation as this rank's GPU addresses it: its own; a peer thread's
/// directly, once this context may access the peer's GPU; another process's through its IPC
/// handle (opened into `m`).
fn map_peers(all: &[Record], me: usize, m: &mut Mapping) -> Result<Vec<u64>> {
    let mine = all[me];
    let mut bases = Vec::with_capacity(all.len());
    for (r, peer) in all.iter().enumerate() {
        if r == me {
            bases.push(m.own);
        } else if peer.pid == mine.pid {
            if peer.ordinal != mine.ordinal {
                enable_peer_access(&m.context, peer.ordinal as usize)?;
            }
            bases.push(peer.ptr);
        } else {
            let Some(words) = peer.handle else {
                return Err(CudaError::Unsupported(format!(
                    "rank {r}'s driver exported no IPC handle for its merge memory"
                )));
            };
            let handle = handle_from_words(&words);
            let mut ptr: CUdeviceptr = 0;
            let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
            // SAFETY: a handle another process exported for memory it keeps until the world
            // ends; `ptr` is written.
            unsafe { sys::cuIpcOpenMemHandle_v2(&mut ptr, handle, flags) }
                .result()
                .ctx(format!("cuIpcOpenMemHandle (rank {r}'s merge memory)"))?;
            m.opened.push(ptr);
            bases.push(ptr);
        }
    }
    Ok(bases)
}

/// Lets `context`'s GPU read and write GPU `ordinal`'s memory.
fn enable_peer_access(context: &CudaContext, ordinal: usize) -> Result<()> {
    let peer = result::device::get(ordinal as i32).ctx("cuDeviceGet")?;
    let mut can = 0;
    // SAFETY: two valid devices; `can` is written.
    unsafe { sys::cuDeviceCanAccessPeer(&mut can, context.cu_device(), peer) }
        .result()
        .ctx("cuDeviceCanAccessPeer")?;
    if can == 0 {
        return Err(CudaError::Unsupported(format!(
            "GPU {} cannot access GPU {ordinal}'s memory",
            context.ordinal()
        )));
    }
    // SAFETY: the peer's primary context, which its rank holds; retained for the call only.
    let peer_ctx = unsafe { result::primary_ctx::retain(peer) }.ctx("cuDevicePrimaryCtxRetain")?;
    // SAFETY: `context` is current on this thread (bound by the caller); `peer_ctx` is valid.
    let enabled = unsafe { sys::cuCtxEnablePeerAccess(peer_ctx, 0) };
    // SAFETY: releases the reference retained above.
    unsafe { result::primary_ctx::release(peer) }.ctx("cuDevicePrimaryCtxRelease")?;
    match enabled {
        sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {
            Ok(())
        }
        e => e.result().ctx("cuCtxEnablePeerAccess"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_round_trips_through_its_words() {
        for handle in [
            None,
            Some(std::array::from_fn(|i| 0x0101_0101 * i as u64 + 7)),
        ] {
            let r = Record {
                pid: 4242,
                host: host_hash("node-a"),
                ordinal: 3,
                willing: 1,
                ptr: 0x7f00_0000_1000,
                handle,
            };
            let back = Record::from_words(&r.words());
            assert_eq!(
                (
                    back.pid,
                    back.host,
                    back.ordinal,
                    back.willing,
                    back.ptr,
                    back.handle
                ),
                (r.pid, r.host, r.ordinal, r.willing, r.ptr, r.handle)
            );
        }
    }

    #[test]
    fn an_ipc_handle_round_trips_through_its_words() {
        let handle = sys::CUipcMemHandle {
            reserved: std::array::from_fn(|i| (i as i32 * 37 - 100) as _),
        };
        let back = handle_from_words(&handle_words(&handle));
        assert_eq!(back.reserved, handle.reserved);
    }

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
