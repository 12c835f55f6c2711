//! Device memory that every rank's GPU maps: one allocation a rank, which each peer addresses
//! directly, for kernels and copies that write into another GPU's memory (the tree's peer
//! merge, the ring's copy-engine hand-off).
//!
//! Ranks that are threads of one process address each other's allocations once peer access is
//! enabled between their GPUs' contexts; ranks in other processes of the same host open them
//! by CUDA IPC handle. The allocations are `cuMemAlloc`'s, not the stream-ordered pool's: IPC
//! handles and context peer access cover only those. Mapping is collective: the ranks tell
//! each other their allocations over the host collective they were started with and agree,
//! by vote, whether every rank mapped every peer, so that either every rank uses the memory
//! or none does.

use crate::backend::CudaBackend;
use crate::error::{CudaError, DriverContext, Result};
use canopy_comm::{Collective, ReduceOp};
use cudarc::driver::sys::{self, CUdeviceptr};
use cudarc::driver::{result, CudaContext};
use std::hash::{Hash, Hasher};
use std::sync::Arc;

/// Words one rank tells the others about its allocation (`Record`).
const RECORD_WORDS: usize = 14;

/// One allocation on each rank, zeroed, as this rank's GPU addresses every rank's; released
/// on drop.
pub(crate) struct PeerMemory {
    /// Bytes of each rank's allocation.
    pub(crate) bytes: usize,
    /// Every rank's allocation as this GPU addresses it, in rank order.
    pub(crate) bases: Vec<u64>,
    _mapping: Mapping,
}

impl PeerMemory {
    /// Allocates `bytes` of zeroed memory on this rank and maps every rank's, together with
    /// every rank of `host`'s world. The inner error is the reason, agreed by every rank, that
    /// the memory is not mapped: a rank not `willing` (its user's switch, `switch`, says no, or
    /// its GPU lacks what the user needs), an allocation that failed, ranks on several hosts,
    /// or a peer a rank could not map. `what` names the memory in errors.
    pub(crate) fn map<H: Collective>(
        host: &H,
        b: &CudaBackend,
        bytes: usize,
        (switch, willing): (&str, bool),
        what: &str,
    ) -> Result<std::result::Result<PeerMemory, String>> {
        let (me, ranks) = (host.rank(), host.size());
        let context = b.stream().context().clone();
        context.bind_to_thread().ctx("cuCtxSetCurrent")?;
        let own = if !willing {
            None
        } else {
            allocate(bytes, what).ok()
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
                "rank {r} declined {what} ({switch}, or its GPU) or could not allocate them"
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
        let mapped = map_peers(&all, me, m, what);
        let mut votes = [mapped.is_err() as u8];
        host.all_reduce(&mut votes[..], ReduceOp::Max)
            .map_err(canopy_engine::EngineError::from)?;
        let bases = match (mapped, votes[0]) {
            (Ok(bases), 0) => bases,
            (Err(e), _) => return Ok(Err(format!("rank {me} could not map a peer's {what}: {e}"))),
            (Ok(_), _) => return Ok(Err(format!("a rank could not map a peer's {what}"))),
        };
        Ok(Ok(PeerMemory {
            bytes,
            bases,
            _mapping: mapping.expect("every rank was willing"),
        }))
    }
}

/// A path over peer memory on one rank: not tried yet, off for the world (every rank agreed
/// it does not run), or set up with what it runs on.
pub(crate) enum PeerState<T> {
    Untried,
    Off,
    On(T),
}

impl<T> PeerState<T> {
    /// Whether the path runs: `None` until every rank has set it up or agreed it cannot.
    pub(crate) fn active(&self) -> Option<bool> {
        match self {
            PeerState::Untried => None,
            PeerState::Off => Some(false),
            PeerState::On(_) => Some(true),
        }
    }
}

/// What a rank tells the others about its allocation.
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

/// The memory this rank allocated and the peers' it opened, released on drop.
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

fn host_hash(name: &str) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    name.hash(&mut h);
    h.finish()
}

/// `bytes` of zeroed device memory in the current context, and its IPC handle where the
/// driver exports one (ranks in other processes need it; threads of this one do not).
fn allocate(bytes: usize, what: &str) -> Result<(CUdeviceptr, Option<[u64; 8]>)> {
    // SAFETY: a fresh allocation of `bytes`, zeroed before anyone can see it.
    let ptr = unsafe { result::malloc_sync(bytes) }.ctx(format!("cuMemAlloc ({what})"))?;
    // SAFETY: `ptr` holds `bytes` bytes.
    // The memset runs on the legacy stream, unordered with the ranks' non-blocking streams and
    // possibly after this call returns: it must be done before a peer can write a flag here.
    // SAFETY: `ptr` holds `bytes` bytes; the null stream is the context's legacy stream.
    let zeroed = unsafe { result::memset_d8_sync(ptr, 0, bytes) }
        .and_then(|()| unsafe { sys::cuStreamSynchronize(std::ptr::null_mut()) }.result());
    if let Err(e) = zeroed {
        // SAFETY: allocated above, freed once.
        let _ = unsafe { result::free_sync(ptr) };
        return Err(e).ctx(format!("cuMemsetD8 ({what})"));
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
fn map_peers(all: &[Record], me: usize, m: &mut Mapping, what: &str) -> Result<Vec<u64>> {
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
                    "rank {r}'s driver exported no IPC handle for its {what}"
                )));
            };
            let handle = handle_from_words(&words);
            let mut ptr: CUdeviceptr = 0;
            let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
            // SAFETY: a handle another process exported for memory it keeps until the world
            // ends; `ptr` is written.
            unsafe { sys::cuIpcOpenMemHandle_v2(&mut ptr, handle, flags) }
                .result()
                .ctx(format!("cuIpcOpenMemHandle (rank {r}'s {what})"))?;
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
}
