//! The ring's hand-off by the copy engines, where every rank's GPU maps every other rank's
//! memory (GPUs of one node over NVLink).
//!
//! A ring step hands each rank's shard of K and V to the next rank, tens to hundreds of
//! megabytes a layer. NCCL's send and receive move it with SM kernels through NCCL's own
//! buffers; between H200s they carry about 240-280 GB/s at 2 ranks and half that a rank at 4,
//! where the copy engines carry 350-380 GB/s at both (BENCHMARKS, sessions 40-43). Here the
//! copy engines do it:
//!
//! - **Landing slots.** Each rank has two slots (alternate hops) of K and V capacity in memory
//!   every peer maps ([`PeerMemory`]), behind two flags: `arrived`, which the previous rank
//!   raises as each piece lands, and `freed`, which the next rank raises when it has copied a
//!   slot out.
//! - **Push.** On a stream of its own, a rank waits until the next rank has freed the slot it
//!   is about to fill (its hop before last), copies each piece of its shard into that slot, and
//!   raises the next rank's `arrived` after each (a stream write, fenced after the copy).
//! - **Land.** On another stream, a rank waits for each piece's flag and copies the piece from
//!   its slot into the receiving KV, so the copy out overlaps the later pieces' arrival; then it
//!   frees the slot by raising the previous rank's `freed`.
//!
//! The flags only grow (hop `n`'s piece `i` raises `arrived` to `n × MAX_PIECES + i + 1`, its
//! slot's release `freed` to `n + 1`), so a wait is "at least", never a race with a later hop.
//! No host waits on a peer: the streams wait on the GPU, and the compute stream waits for the
//! hop's last copy. A peer that stops leaves the streams waiting, and the host's next wait,
//! through the transport's watchdog, ends the run.
//!
//! Setting up is collective, as is growing the slots when a larger shard comes: every hop the
//! ranks agree, over the host collective, on the largest shard, so every rank sets up at the
//! same hop or none does. A set-up ends with every path between GPUs taken once and a barrier,
//! as the driver's set-up of a path at its first use may wait for the peer GPU, whose streams
//! in a hop wait on this rank. Unless every rank has `CANOPY_PEER_RING=on`, maps every peer and
//! has 64-bit stream memory operations, every rank hands off through NCCL.

use crate::backend::CudaBackend;
use crate::error::{DriverContext, Result};
use crate::kv::CudaKv;
use crate::nccl_transport::{hand_off_pieces, record, staging, Cut};
use crate::peer_memory::{PeerMemory, PeerState};
use canopy_comm::{Collective, ReduceOp};
use cudarc::driver::sys::{self, CUdeviceptr};
use cudarc::driver::{result, CudaEvent, CudaSlice, CudaStream, DevicePtr};
use std::cell::{Cell, RefCell};
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Set to `on` (on every rank) to hand the ring's shards off on the copy engines; otherwise
/// they go through NCCL. Opt-in: a model's ring at 4 ranks has not yet passed its checks on
/// this path (`docs/BENCHMARKS.md`, sessions 43 and 44).
pub const PEER_RING_SWITCH: &str = "CANOPY_PEER_RING";

/// Where a rank's flags sit in its memory, a cache line apart: `arrived` (written by the
/// previous rank) and `freed` (written by the next).
const ARRIVED_AT: u64 = 0;
const FREED_AT: u64 = 128;
/// Bytes before the landing slots.
const FLAGS_BYTES: usize = 256;
/// How long a ring being dropped waits for the next rank's last release of its slot.
const RELEASE_WAIT: Duration = Duration::from_secs(10);
/// The least bytes of K (or V) a slot holds: a model's small shards, which grow token by
/// token, set up once.
const MIN_SLOT_BYTES: usize = 4 << 20;
/// Arrival flag values a hop spans: more than any hop's pieces.
const MAX_PIECES: u64 = 16;
/// How the copy engines' hand-off is cut: pieces of 8 MB of K (or V) or more, at most 8, so
/// the copy out of the slot trails the arrival by one piece.
pub(crate) const PEER_CUT: Cut = Cut {
    min_bytes: 8 << 20,
    max_pieces: 8,
};

/// One rank's ring hand-off by the copy engines: not tried yet, off for the world, or set up
/// with slots for the largest shard so far.
pub(crate) struct PeerRing {
    state: RefCell<PeerState<Slots>>,
    /// Hops started since the slots were set up; every rank starts the same ones.
    hops: Cell<u64>,
    /// Bytes this rank has copied into the next rank's slots.
    sent: Cell<u64>,
    /// Slots outgrown, freed with the ring.
    retired: RefCell<Vec<PeerMemory>>,
}

/// The landing slots, mapped on every rank, and the two streams that fill and empty them.
struct Slots {
    memory: PeerMemory,
    /// This rank's place in `memory.bases`.
    rank: usize,
    /// Bytes of K (and of V) one slot holds.
    slot_bytes: usize,
    push: Arc<CudaStream>,
    land: Arc<CudaStream>,
}

impl Slots {
    /// Where K (`0`) or V (`1`) of slot `parity` begins in the memory at `base`.
    fn slot(&self, base: u64, parity: u64, side: u64) -> u64 {
        base + slot_offset(self.slot_bytes, parity, side)
    }

    /// Takes every path the hops take, once, and waits for it: a copy and a flag write into
    /// the next rank's memory on the push stream; a copy within this rank's memory and a flag
    /// write into the previous rank's on the landing stream; a wait on this rank's flags on
    /// each. The driver sets a path between GPUs up at its first use, and that may wait for
    /// the peer GPU's streams; in a hop those streams wait on flags this rank raises after the
    /// first use, so a first use in a hop can wait for ever (seen on four H200s: a rank's host
    /// blocked in its first hop's push, with every GPU idle). The caller's barrier then keeps
    /// every rank from its first hop until every rank has taken every path. The flags written
    /// are still zero, and each is written by this rank alone, before its hops raise it.
    fn warm_up(&self, idle: &impl Fn(&CudaEvent) -> Result<()>) -> Result<()> {
        let (me, p) = (self.rank, self.memory.bases.len());
        let bases = &self.memory.bases;
        let (own, next, prev) = (bases[me], bases[(me + 1) % p], bases[(me + p - 1) % p]);
        let bytes = 0..FLAGS_BYTES.min(self.slot_bytes);
        wait_value(&self.push, own + FREED_AT, 0)?;
        let (into, from) = (self.slot(next, 0, 0), self.slot(own, 0, 0));
        copy(&self.push, into, from, bytes.clone(), "the ring's warm-up")?;
        write_value(&self.push, next + ARRIVED_AT, 0)?;
        wait_value(&self.land, own + ARRIVED_AT, 0)?;
        let (into, from) = (self.slot(own, 1, 0), self.slot(own, 0, 0));
        copy(&self.land, into, from, bytes, "the ring's warm-up")?;
        write_value(&self.land, prev + FREED_AT, 0)?;
        idle(&record(&self.push)?)?;
        idle(&record(&self.land)?)
    }

    /// Whether the next rank has released the slot of the last of `hops` hops, within
    /// [`RELEASE_WAIT`]. That release is the one write into this rank's memory its own hops
    /// never wait for.
    fn released(&self, hops: u64) -> bool {
        if hops == 0 {
            return true;
        }
        let own = self.memory.bases[self.rank];
        let waited = self
            .push
            .context()
            .bind_to_thread()
            .ctx("cuCtxSetCurrent")
            .and_then(|()| wait_value(&self.push, own + FREED_AT, hops))
            .and_then(|()| record(&self.push));
        let Ok(event) = waited else {
            return false;
        };
        let deadline = Instant::now() + RELEASE_WAIT;
        while Instant::now() < deadline {
            if event.is_complete() {
                return true;
            }
            std::thread::sleep(Duration::from_micros(100));
        }
        false
    }
}

/// Bytes from a rank's memory's start to K (`side` 0) or V (1) of slot `parity`, for slots of
/// `slot_bytes` a side: the flags first, then both sides of slot 0, then slot 1's.
fn slot_offset(slot_bytes: usize, parity: u64, side: u64) -> u64 {
    FLAGS_BYTES as u64 + (2 * parity + side) * slot_bytes as u64
}

/// A hop the copy engines carry: the gathered shard it sends (paged KV), which lives until
/// the compute stream has waited for `done`, the hop's last copy.
pub(crate) struct PeerHop {
    pub(crate) gathered: Option<(CudaSlice<u8>, CudaSlice<u8>)>,
    pub(crate) done: CudaEvent,
}

impl PeerRing {
    pub(crate) fn new() -> PeerRing {
        PeerRing {
            state: RefCell::new(PeerState::Untried),
            hops: Cell::new(0),
            sent: Cell::new(0),
            retired: RefCell::new(Vec::new()),
        }
    }

    /// Starts one hop: tokens `0..send_tokens` of `send` to the next rank, `recv_tokens` from
    /// the previous rank into `recv`, once `b`'s stream has finished what it enqueued. `None`
    /// where the copy engines do not hand off (agreed by every rank: the call is collective),
    /// and the caller hands off through NCCL. `idle` waits, through the watchdog, until an
    /// event has completed.
    pub(crate) fn start<H: Collective>(
        &self,
        host: &H,
        b: &CudaBackend,
        (send, send_tokens): (&CudaKv, usize),
        (recv, recv_tokens): (&mut CudaKv, usize),
        idle: impl Fn(&CudaEvent) -> Result<()>,
    ) -> Result<Option<PeerHop>> {
        CudaBackend::check_tokens("the ring's hand-off", send, 0, send_tokens)?;
        CudaBackend::check_tokens("the ring's hand-off", recv, 0, recv_tokens)?;
        if host.size() < 2 || matches!(*self.state.borrow(), PeerState::Off) {
            return Ok(None);
        }
        // Every rank's largest side, and whether any receives into paged KV (which goes
        // through NCCL's path and its scatter).
        let mut need = [
            send.bytes_of(send_tokens).max(recv.bytes_of(recv.tokens)) as u64,
            recv.paging.is_some() as u64,
        ];
        host.all_reduce(&mut need[..], ReduceOp::Max)
            .map_err(canopy_engine::EngineError::from)?;
        if need[1] != 0 {
            return Ok(None);
        }
        let slot_bytes = need[0] as usize;
        if !matches!(&*self.state.borrow(), PeerState::On(s) if s.slot_bytes >= slot_bytes) {
            self.set_up(host, b, slot_bytes, &idle)?;
        }
        let state = self.state.borrow();
        let PeerState::On(slots) = &*state else {
            return Ok(None);
        };
        let hop = self.hops.get();
        self.hops.set(hop + 1);
        tracing::debug!(
            rank = slots.rank,
            hop,
            send_tokens,
            recv_tokens,
            slot_bytes = slots.slot_bytes,
            "the ring's hop on the copy engines starts"
        );
        let ready = record(b.stream())?;
        slots.push.wait(&ready).ctx("cuStreamWaitEvent")?;
        slots.land.wait(&ready).ctx("cuStreamWaitEvent")?;
        let gathered = self.push(b, slots, hop, send, send_tokens)?;
        self.land(slots, hop, recv, recv_tokens)?;
        slots
            .land
            .wait(&record(&slots.push)?)
            .ctx("cuStreamWaitEvent")?;
        tracing::debug!(rank = slots.rank, hop, "the ring's hop enqueued");
        Ok(Some(PeerHop {
            gathered,
            done: record(&slots.land)?,
        }))
    }

    /// Whether the copy engines hand the ring's shards off: `None` until the first hand-off.
    pub(crate) fn active(&self) -> Option<bool> {
        self.state.borrow().active()
    }

    /// Bytes this rank has copied into its peers' memory.
    pub(crate) fn bytes_sent(&self) -> u64 {
        self.sent.get()
    }

    /// Sets up slots of `slot_bytes` (at least twice the old ones), or agrees with every rank
    /// that the copy engines do not hand off. The old slots' hops have ended on this rank once
    /// its streams are idle, and on every rank once the set-up's exchange is done.
    fn set_up<H: Collective>(
        &self,
        host: &H,
        b: &CudaBackend,
        slot_bytes: usize,
        idle: &impl Fn(&CudaEvent) -> Result<()>,
    ) -> Result<()> {
        let old = std::mem::replace(&mut *self.state.borrow_mut(), PeerState::Untried);
        let (streams, had) = match old {
            PeerState::On(Slots {
                memory,
                slot_bytes,
                push,
                land,
                ..
            }) => {
                idle(&record(&push)?)?;
                idle(&record(&land)?)?;
                // Freeing memory that peers map may wait for their GPUs, which may by then be
                // waiting on this rank's flags: the old slots are kept, unused, until the ring
                // ends. Each is at most half the next, so they cost less than the last.
                self.retired.borrow_mut().push(memory);
                (Some((push, land)), slot_bytes)
            }
            _ => (None, 0),
        };
        let slot_bytes = slot_bytes.max(2 * had).max(MIN_SLOT_BYTES);
        let context = b.stream().context();
        let willing = std::env::var(PEER_RING_SWITCH).is_ok_and(|v| v == "on") && memory_ops_64(b)?;
        let bytes = FLAGS_BYTES + 4 * slot_bytes;
        let what = "the ring's landing slots";
        let state = match PeerMemory::map(host, b, bytes, (PEER_RING_SWITCH, willing), what)? {
            Ok(memory) => {
                tracing::info!(
                    rank = host.rank(),
                    slot_bytes,
                    "the ring's hand-off runs on the copy engines over the peers' memory"
                );
                let new_stream = || context.new_stream().ctx("cuStreamCreate");
                let (push, land) = match streams {
                    Some(streams) => streams,
                    None => (new_stream()?, new_stream()?),
                };
                let slots = Slots {
                    memory,
                    rank: host.rank(),
                    slot_bytes,
                    push,
                    land,
                };
                slots.warm_up(idle)?;
                host.barrier().map_err(canopy_engine::EngineError::from)?;
                PeerState::On(slots)
            }
            Err(reason) => {
                tracing::info!(rank = host.rank(), %reason, "the ring's hand-off goes through NCCL");
                PeerState::Off
            }
        };
        *self.state.borrow_mut() = state;
        self.hops.set(0);
        Ok(())
    }

    /// Hop `hop`'s push: once the next rank has freed the slot, each piece of the shard into
    /// it (a paged shard gathered piece by piece on `b`'s stream first), each followed by the
    /// next rank's arrival flag.
    fn push(
        &self,
        b: &CudaBackend,
        slots: &Slots,
        hop: u64,
        send: &CudaKv,
        tokens: usize,
    ) -> Result<Option<(CudaSlice<u8>, CudaSlice<u8>)>> {
        let (me, p) = (slots.rank, slots.memory.bases.len());
        let next = slots.memory.bases[(me + 1) % p];
        let own = slots.memory.bases[me];
        let parity = hop % 2;
        // The slot was last filled at hop - 2, freed when the next rank raised `freed` to
        // hop - 1.
        wait_value(&slots.push, own + FREED_AT, hop.saturating_sub(1))?;
        let mut gathered = match send.paging {
            Some(_) => Some(staging(b, send, tokens)?),
            None => None,
        };
        let token_bytes = send.bytes_of(1);
        for (i, piece) in pieces(tokens, token_bytes).into_iter().enumerate() {
            let bytes = piece.start * token_bytes..piece.end * token_bytes;
            let (k, v) = match gathered.as_mut() {
                Some((k, v)) => {
                    b.gather_tokens(send, piece.clone(), (k, v))?;
                    slots
                        .push
                        .wait(&record(b.stream())?)
                        .ctx("cuStreamWaitEvent")?;
                    (ptr(&slots.push, k), ptr(&slots.push, v))
                }
                None => (ptr(&slots.push, &send.k), ptr(&slots.push, &send.v)),
            };
            for (side, src) in [k, v].into_iter().enumerate() {
                let dst = slots.slot(next, parity, side as u64);
                copy(&slots.push, dst, src, bytes.clone(), "the ring's push")?;
            }
            write_value(&slots.push, next + ARRIVED_AT, arrival(hop, i))?;
            self.sent.set(self.sent.get() + 2 * bytes.len() as u64);
        }
        Ok(gathered)
    }

    /// Hop `hop`'s landing: each piece out of this rank's slot into `recv` as its flag rises,
    /// then the previous rank's `freed` raised for the slot.
    fn land(&self, slots: &Slots, hop: u64, recv: &mut CudaKv, tokens: usize) -> Result<()> {
        let (me, p) = (slots.rank, slots.memory.bases.len());
        let (own, prev) = (slots.memory.bases[me], slots.memory.bases[(me + p - 1) % p]);
        let parity = hop % 2;
        let token_bytes = recv.bytes_of(1);
        let into = [ptr(&slots.land, &recv.k), ptr(&slots.land, &recv.v)];
        for (i, piece) in pieces(tokens, token_bytes).into_iter().enumerate() {
            wait_value(&slots.land, own + ARRIVED_AT, arrival(hop, i))?;
            let bytes = piece.start * token_bytes..piece.end * token_bytes;
            for (side, dst) in into.into_iter().enumerate() {
                let src = slots.slot(own, parity, side as u64);
                copy(&slots.land, dst, src, bytes.clone(), "the ring's landing")?;
            }
        }
        write_value(&slots.land, prev + FREED_AT, hop + 1)
    }
}

impl Drop for PeerRing {
    /// The slots are freed once the next rank has released the last one filled; a peer that
    /// never does (it failed) may still write into them, so they are then left to the
    /// process's end rather than freed under it.
    fn drop(&mut self) {
        if let PeerState::On(slots) = std::mem::replace(self.state.get_mut(), PeerState::Off) {
            let released = slots.released(self.hops.get());
            tracing::debug!(
                rank = slots.rank,
                hops = self.hops.get(),
                released,
                "the ring's slots dropped"
            );
            if !released {
                std::mem::forget(slots);
            }
        }
    }
}

/// The logical token ranges of a hop of `tokens` tokens: the sender and the receiver cut
/// alike, from the same two numbers.
fn pieces(tokens: usize, token_bytes: usize) -> Vec<Range<usize>> {
    hand_off_pieces(tokens, token_bytes, PEER_CUT)
}

/// The value hop `hop`'s piece `i` raises `arrived` to.
fn arrival(hop: u64, piece: usize) -> u64 {
    hop * MAX_PIECES + piece as u64 + 1
}

/// Whether `b`'s GPU waits on and writes 64-bit values from a stream.
fn memory_ops_64(b: &CudaBackend) -> Result<bool> {
    let attribute = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS;
    let device = b.stream().context().cu_device();
    // SAFETY: a valid device and attribute.
    let can = unsafe { result::device::get_attribute(device, attribute) }
        .ctx("cuDeviceGetAttribute (64-bit stream memory operations)")?;
    Ok(can != 0)
}

/// `s`'s device address, for copies the driver orders on `stream`.
fn ptr(stream: &CudaStream, s: &CudaSlice<u8>) -> CUdeviceptr {
    s.device_ptr(stream).0
}

/// Bytes `range` of `src` to the same bytes of `dst`, on `stream`'s copy engine; nothing for
/// an empty range.
fn copy(
    stream: &CudaStream,
    dst: CUdeviceptr,
    src: CUdeviceptr,
    range: Range<usize>,
    what: &str,
) -> Result<()> {
    if range.is_empty() {
        return Ok(());
    }
    let at = range.start as u64;
    // SAFETY: both ranges lie in live allocations this rank's GPU maps: the callers size the
    // slots for the largest shard every rank agreed, and check the KV's tokens.
    unsafe { result::memcpy_dtod_async(dst + at, src + at, range.len(), stream.cu_stream()) }
        .ctx(format!("cuMemcpyDtoDAsync ({what})"))
}

/// `stream` waits until the 64-bit flag at `addr` is at least `value`.
fn wait_value(stream: &CudaStream, addr: CUdeviceptr, value: u64) -> Result<()> {
    let geq = sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32;
    // SAFETY: `addr` is a flag in memory this GPU maps, live while the slots are.
    unsafe { sys::cuStreamWaitValue64_v2(stream.cu_stream(), addr, value, geq) }
        .result()
        .ctx("cuStreamWaitValue64")
}

/// `stream` writes `value` to the 64-bit flag at `addr`, after a fence over the writes
/// before it (the copies the flag announces).
fn write_value(stream: &CudaStream, addr: CUdeviceptr, value: u64) -> Result<()> {
    let fenced = sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32;
    // SAFETY: `addr` is a flag in memory this GPU maps, live while the slots are.
    unsafe { sys::cuStreamWriteValue64_v2(stream.cu_stream(), addr, value, fenced) }
        .result()
        .ctx("cuStreamWriteValue64")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A hop's flag values stay below the next hop's, however many pieces it has.
    #[test]
    fn arrivals_grow_across_hops() {
        let last = pieces(1 << 22, 4096).len() - 1;
        assert!(last < MAX_PIECES as usize);
        assert!(arrival(7, last) < arrival(8, 0));
        assert!(
            arrival(0, 0) > 0,
            "the zeroed flag is below the first arrival"
        );
    }

    /// The slots of both parities and both sides lie after the flags, apart, inside the
    /// memory set up for them.
    #[test]
    fn slots_fit_their_memory() {
        let slot_bytes = 3 << 20;
        let bytes = (FLAGS_BYTES + 4 * slot_bytes) as u64;
        let mut starts: Vec<u64> = (0..2)
            .flat_map(|parity| (0..2).map(move |side| slot_offset(slot_bytes, parity, side)))
            .collect();
        starts.sort();
        assert_eq!(starts[0], FLAGS_BYTES as u64);
        assert!(starts.windows(2).all(|w| w[1] - w[0] == slot_bytes as u64));
        assert_eq!(starts[3] + slot_bytes as u64, bytes);
        assert!(FREED_AT + 8 <= FLAGS_BYTES as u64 && ARRIVED_AT + 8 <= FREED_AT);
    }
}
