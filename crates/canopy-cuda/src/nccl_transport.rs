//! The engine's [`Transport`] over NCCL: one rank per GPU, device buffers straight into NCCL's
//! calls, every wait through the rank's [`Watchdog`].
//!
//! - **Collectives** (the tree's merge) run on the backend's own stream, in order with its
//!   kernels: no event between a kernel and the all-reduce that reads its output.
//! - **The all-gather merge** runs as one kernel over the peers' memory where every rank's GPU
//!   maps every other's (the `peer_merge` module: GPUs of one host), else as NCCL's all-gather
//!   between the states' packing and their fold.
//! - **The hierarchical merge** runs on sub-communicators: each node's (the members' states
//!   to their leader as grouped receives, the result back as a broadcast) and the leaders'
//!   (an in-place all-gather).
//! - **The ring's hand-off** runs on a stream of its own, double-buffered: the send of the
//!   shard being computed on and the receive of the next proceed as NCCL groups while the
//!   backend computes. Events order the two streams: the hand-off starts once the compute
//!   stream has finished with the buffer it receives into, and the compute stream reads that
//!   buffer only after the hand-off's arrival event. A large shard goes in pieces, a group
//!   each, so a rank's own paged shard is gathered piece by piece while the pieces before
//!   it are sent. With `CANOPY_PEER_RING=on` on every rank, where every rank's GPU maps every
//!   other's, the copy engines carry it instead (the `peer_ring` module), on streams of
//!   their own, ordered with the compute stream the same way.
//! - **Host-side calls** (host names, barriers) go to the host collective the ranks were
//!   started with ([`canopy_comm::ThreadComm`], or MPI's); traffic counts both.
//!
//! Every wait polls the communicators' asynchronous errors and counts as progress for the
//! watchdog, which ends the process, naming the rank and the NCCL call, when a peer died or
//! stalled: a dead peer is an error, never a hang.

use crate::backend::{CudaBackend, CudaStates};
use crate::error::{CudaError, DriverContext, Result};
use crate::kv::CudaKv;
use crate::nccl::{group, NcclComm, NcclOp, Watchdog};
use crate::peer_merge::PeerMerge;
use crate::peer_ring::PeerRing;
use canopy_comm::{Collective, Group, HostPart, ReduceOp, Traffic};
use canopy_engine::layer_ops::expect_room;
use canopy_engine::{Cache, MergeCollective, NodeLayout, Result as EResult, Strategy, Transport};
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, CudaView, CudaViewMut};
use cudarc::nccl::Id;
use std::cell::RefCell;
use std::ops::Range;
use std::time::Duration;

/// The NCCL unique ids of one run: the world's, each node's, and the node leaders'.
#[derive(Clone)]
pub struct NcclIds {
    world: Id,
    nodes: Vec<Id>,
    leaders: Id,
}

/// Bytes of one NCCL unique id.
const ID_BYTES: usize = 128;

impl NcclIds {
    /// Fresh ids for a world of `nodes` nodes (made by one rank, handed to the others).
    pub fn new(nodes: usize) -> Result<NcclIds> {
        let id = || Id::new().map_err(nccl_id_error);
        Ok(NcclIds {
            world: id()?,
            nodes: (0..nodes).map(|_| id()).collect::<Result<_>>()?,
            leaders: id()?,
        })
    }

    /// Ids of a world of `nodes` nodes made by rank 0 of `host` and handed to every rank over
    /// it.
    pub fn from_rank0<H: Collective>(host: &H, nodes: usize) -> EResult<NcclIds> {
        let bytes = match host.rank() {
            0 => NcclIds::new(nodes)?.to_bytes(),
            _ => vec![0u8; NcclIds::byte_len(nodes)],
        };
        let mut all = vec![0u8; bytes.len() * host.size()];
        host.all_gather(&bytes, &mut all)?;
        Ok(NcclIds::from_bytes(&all[..bytes.len()])?)
    }

    /// Bytes of the ids of a world of `nodes` nodes, as [`NcclIds::to_bytes`] writes them.
    pub fn byte_len(nodes: usize) -> usize {
        ID_BYTES * (nodes + 2)
    }

    /// The ids as bytes, to travel to the other ranks.
    pub fn to_bytes(&self) -> Vec<u8> {
        std::iter::once(&self.world)
            .chain(&self.nodes)
            .chain([&self.leaders])
            .flat_map(|id| id.internal().iter().map(|&c| c as u8))
            .collect()
    }

    /// The ids [`NcclIds::to_bytes`] wrote.
    pub fn from_bytes(bytes: &[u8]) -> Result<NcclIds> {
        if bytes.len() < 2 * ID_BYTES || !bytes.len().is_multiple_of(ID_BYTES) {
            return Err(CudaError::Unsupported(format!(
                "NCCL ids of {} bytes: expected a multiple of {ID_BYTES}, at least two ids",
                bytes.len()
            )));
        }
        let mut ids: Vec<Id> = bytes
            .chunks(ID_BYTES)
            .map(|c| Id::uninit(std::array::from_fn(|i| c[i] as std::ffi::c_char)))
            .collect();
        let leaders = ids.pop().expect("at least two ids");
        let world = ids.remove(0);
        Ok(NcclIds {
            world,
            nodes: ids,
            leaders,
        })
    }
}

fn nccl_id_error(e: cudarc::nccl::result::NcclError) -> CudaError {
    CudaError::Nccl {
        rank: 0,
        call: "ncclGetUniqueId",
        detail: format!("{:?}", e.0),
    }
}

/// One rank's NCCL transport: its communicators, its watchdog, and the host collective it
/// was started with.
pub struct NcclTransport<'h, H: Collective> {
    host: &'h H,
    world: NcclComm,
    /// This rank's node and, on leaders, the leaders' (hierarchical merges only).
    node: Option<NcclComm>,
    leaders: Option<NcclComm>,
    layout: NodeLayout,
    watchdog: Watchdog,
    /// The ring's arrival event, between [`Transport::start_kv_exchange`] and its finish.
    arrived: RefCell<Option<CudaEvent>>,
    /// A hand-off's buffers for its paged sides, between its start and its finish.
    staged: RefCell<Option<Staged>>,
    /// The all-gather merge in one kernel, where the ranks' GPUs map each other's memory.
    peer: PeerMerge,
    /// The ring's hand-off on the copy engines, where the ranks' GPUs map each other's memory.
    ring: PeerRing,
}

/// Paged KV travels in logical order through contiguous buffers: a paged shard sent is gathered
/// on the compute stream before the hand-off, and one arriving for paged KV is scattered into
/// its pages after it. Contiguous KV (the ring's own buffers) is sent and received in place.
struct Staged {
    /// The paged shard sent, gathered; it lives until the compute stream has waited for the
    /// hand-off.
    sent: Option<(CudaSlice<u8>, CudaSlice<u8>)>,
    /// The shard arriving for paged KV, to scatter.
    arriving: Option<(CudaSlice<u8>, CudaSlice<u8>)>,
    tokens: usize,
}

impl<'h, H: Collective> NcclTransport<'h, H> {
    /// Joins the communicators of `ids` as rank `host.rank()` of `host.size()`, on
    /// `backend`'s GPU, for `strategy`: the ring's hand-off gets a stream of its own, and a
    /// merge that is or may be hierarchical (`auto` over several nodes) the sub-communicators
    /// of `layout`. Blocks until every rank has joined; the watchdog starts first, so a rank
    /// that never joins ends this one within `timeout`.
    pub fn new(
        host: &'h H,
        backend: &CudaBackend,
        ids: &NcclIds,
        layout: NodeLayout,
        strategy: Strategy,
        timeout: Duration,
    ) -> Result<Self> {
        let (rank, size) = (host.rank(), host.size());
        layout
            .check(size)
            .map_err(|e| CudaError::Unsupported(e.to_string()))?;
        let watchdog = Watchdog::start(rank, timeout);
        let compute = backend.stream().clone();
        let world_stream = match strategy {
            Strategy::Ring => compute.context().new_stream().ctx("cuStreamCreate")?,
            Strategy::Tree(_) => compute.clone(),
        };
        let world = NcclComm::new(world_stream, rank, size, &ids.world)?;
        let sub_comms = match strategy {
            Strategy::Tree(MergeCollective::Hierarchical) => true,
            Strategy::Tree(MergeCollective::Auto) => layout.nodes() > 1,
            _ => false,
        };
        let (node, leaders) = if sub_comms {
            let n = layout.node_of(rank);
            let members = layout.members(n);
            let local = members.iter().position(|&r| r == rank).unwrap_or(0);
            let node = NcclComm::new(compute.clone(), local, members.len(), &ids.nodes[n])?;
            let leaders = match layout.leaders().iter().position(|&l| l == rank) {
                Some(i) => Some(NcclComm::new(compute, i, layout.nodes(), &ids.leaders)?),
                None => None,
            };
            (Some(node), leaders)
        } else {
            (None, None)
        };
        Ok(NcclTransport {
            host,
            world,
            node,
            leaders,
            layout,
            watchdog,
            arrived: RefCell::new(None),
            staged: RefCell::new(None),
            peer: PeerMerge::new(timeout),
            ring: PeerRing::new(),
        })
    }

    /// Whether the tree's all-gather merge runs as one kernel over the peers' memory
    /// (the `peer_merge` module) rather than through NCCL: `None` until the first such merge.
    pub fn peer_merge_active(&self) -> Option<bool> {
        self.peer.active()
    }

    /// Whether the ring's hand-off runs on the copy engines over the peers' memory (the
    /// `peer_ring` module) rather than through NCCL: `None` until the first hand-off.
    pub fn peer_ring_active(&self) -> Option<bool> {
        self.ring.active()
    }

    fn comms(&self) -> Vec<&NcclComm> {
        std::iter::once(&self.world)
            .chain(&self.node)
            .chain(&self.leaders)
            .collect()
    }

    /// Bytes this rank's communicators have sent, by the ring-algorithm formulas, and its
    /// peer merges and copy-engine hand-offs.
    fn wire_bytes(&self) -> u64 {
        let nccl: u64 = self.comms().iter().map(|c| c.wire_bytes()).sum();
        nccl + self.peer.bytes_sent() + self.ring.bytes_sent()
    }

    /// Waits for `event` through the watchdog.
    fn wait_event(&self, event: &CudaEvent) -> Result<()> {
        self.watchdog.wait(event, &self.comms())
    }

    /// Runs `f` on the world communicator in order with `b`'s stream: directly when the world
    /// enqueues on that stream (tree), else between two events (ring).
    fn on_world<T>(&self, b: &CudaBackend, f: impl FnOnce(&NcclComm) -> Result<T>) -> Result<T> {
        let (compute, comm) = (b.stream(), self.world.stream());
        if compute.cu_stream() == comm.cu_stream() {
            return f(&self.world);
        }
        comm.wait(&record(compute)?).ctx("cuStreamWaitEvent")?;
        let out = f(&self.world)?;
        compute.wait(&record(comm)?).ctx("cuStreamWaitEvent")?;
        Ok(out)
    }

    /// The node communicator a hierarchical step needs.
    fn node(&self) -> Result<&NcclComm> {
        self.node.as_ref().ok_or_else(|| {
            CudaError::Unsupported(
                "the hierarchical merge over NCCL needs the node communicators: build the transport for a hierarchical (or auto) merge".into(),
            )
        })
    }

    /// Refuses a layout other than the one the sub-communicators were built for.
    fn check_layout(&self, layout: &NodeLayout) -> Result<()> {
        if *layout != self.layout {
            return Err(CudaError::Unsupported(
                "the hierarchical merge was given another node layout than the NCCL transport was built for".into(),
            ));
        }
        Ok(())
    }

    /// K and V `send` to the next rank, and the previous rank's into `recv`, as one NCCL
    /// group on the world's stream; a side that is `None` has nothing in this group.
    fn hand_off(
        &self,
        send: Option<(&CudaView<u8>, &CudaView<u8>)>,
        recv: Option<(&mut CudaViewMut<u8>, &mut CudaViewMut<u8>)>,
    ) -> Result<()> {
        let (rank, p) = (self.world.rank(), self.world.size());
        let (next, prev) = ((rank + 1) % p, (rank + p - 1) % p);
        let comm = &self.world;
        group(rank, || {
            if let Some((k, v)) = send {
                comm.send("send(K)", k, next)?;
                comm.send("send(V)", v, next)?;
            }
            if let Some((k, v)) = recv {
                comm.recv("recv(K)", k, prev)?;
                comm.recv("recv(V)", v, prev)?;
            }
            Ok(())
        })
    }

    /// The ring's hand-off once `b`'s stream is done with what it enqueued, in the pieces of
    /// [`hand_off_pieces`]: a paged `send` gathered into logical order on `b`'s stream piece by
    /// piece, each piece sent while the next is gathered, a contiguous one sent in place; the
    /// previous rank's shard received in place, or into contiguous buffers for a paged `recv`.
    /// Returns what the finish needs.
    fn start_hand_off(
        &self,
        b: &CudaBackend,
        send: &CudaKv,
        send_tokens: usize,
        recv: &mut CudaKv,
        recv_tokens: usize,
    ) -> Result<Staged> {
        CudaBackend::check_tokens("the ring's hand-off", recv, 0, recv_tokens)?;
        CudaBackend::check_tokens("the ring's hand-off", send, 0, send_tokens)?;
        let mut sent = match &send.paging {
            None => {
                contiguous_bytes("send_kv", send, send_tokens)?;
                None
            }
            Some(_) => Some(staging(b, send, send_tokens)?),
        };
        let mut arriving = match &recv.paging {
            None => {
                contiguous_bytes("recv_kv", recv, recv_tokens)?;
                None
            }
            Some(_) => Some(staging(b, recv, recv_tokens)?),
        };
        let sends = hand_off_pieces(send_tokens, send.bytes_of(1), NCCL_CUT);
        let recvs = hand_off_pieces(recv_tokens, recv.bytes_of(1), NCCL_CUT);
        for i in 0..sends.len().max(recvs.len()) {
            let piece = sends
                .get(i)
                .map(|t| send.bytes_of(t.start)..send.bytes_of(t.end));
            if let (Some(tokens), Some((k, v))) = (sends.get(i), sent.as_mut()) {
                b.gather_tokens(send, tokens.clone(), (k, v))?;
            }
            // The first piece waits for everything the compute stream enqueued (it is done
            // with the buffer received into); each later gathered piece for its gather.
            if i == 0 || (sent.is_some() && piece.is_some()) {
                self.world
                    .stream()
                    .wait(&record(b.stream())?)
                    .ctx("cuStreamWaitEvent")?;
            }
            let views = piece.map(|bytes| match &sent {
                Some((k, v)) => (k.slice(bytes.clone()), v.slice(bytes)),
                None => (send.k.slice(bytes.clone()), send.v.slice(bytes)),
            });
            let into = recvs
                .get(i)
                .map(|t| recv.bytes_of(t.start)..recv.bytes_of(t.end));
            let mut into = into.map(|bytes| match &mut arriving {
                Some((k, v)) => (k.slice_mut(bytes.clone()), v.slice_mut(bytes)),
                None => (recv.k.slice_mut(bytes.clone()), recv.v.slice_mut(bytes)),
            });
            self.hand_off(
                views.as_ref().map(|(k, v)| (k, v)),
                into.as_mut().map(|(k, v)| (k, v)),
            )?;
        }
        Ok(Staged {
            sent,
            arriving,
            tokens: recv_tokens,
        })
    }

    /// The ring's hand-off alone, by whichever path the ring takes, `reps` times after one
    /// warm-up, between events on the compute stream (which waits for each hop's arrival):
    /// bytes sent per second, the link bandwidth a ring's floor divides by.
    pub fn link_bandwidth(
        &self,
        b: &CudaBackend,
        send: &CudaKv,
        send_tokens: usize,
        recv: &mut CudaKv,
        recv_tokens: usize,
        reps: usize,
    ) -> EResult<f64> {
        use cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
        let hop = |recv: &mut CudaKv| -> EResult<()> {
            self.start_kv_exchange(b, send, send_tokens, recv, recv_tokens)?;
            self.finish_kv_exchange(b, recv, recv_tokens)
        };
        hop(recv)?;
        let timed = |s: &CudaStream| s.record_event(Some(CU_EVENT_DEFAULT)).ctx("cuEventRecord");
        let start = timed(b.stream())?;
        for _ in 0..reps.max(1) {
            hop(recv)?;
        }
        let end = timed(b.stream())?;
        self.wait_event(&end)?;
        let ms = start.elapsed_ms(&end).ctx("cuEventElapsedTime")? as f64 / reps.max(1) as f64;
        Ok(2.0 * send.bytes_of(send_tokens) as f64 / (ms * 1e-3))
    }
}

pub(crate) fn record(stream: &CudaStream) -> Result<CudaEvent> {
    stream.record_event(None).ctx("cuEventRecord")
}

/// Contiguous K and V buffers on `b`'s stream for logical tokens `0..tokens` of paged `kv`,
/// which a hand-off gathers into or scatters from; one byte at least, as an allocation of
/// nothing is refused.
pub(crate) fn staging(
    b: &CudaBackend,
    kv: &CudaKv,
    tokens: usize,
) -> Result<(CudaSlice<u8>, CudaSlice<u8>)> {
    let bytes = kv.bytes_of(tokens).max(1);
    Ok((b.alloc::<u8>(bytes)?, b.alloc::<u8>(bytes)?))
}

fn nccl_op(op: ReduceOp) -> NcclOp {
    match op {
        ReduceOp::Sum => NcclOp::Sum,
        ReduceOp::Max => NcclOp::Max,
    }
}

/// How a hand-off is cut into pieces: each of at least `min_bytes` of K (or V) but the last,
/// at most `max_pieces` of them.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Cut {
    pub(crate) min_bytes: usize,
    pub(crate) max_pieces: usize,
}

/// NCCL's hand-off: pieces of 64 MB or more (smaller ones would pay NCCL's cost per call for
/// little overlap), at most four. Only the first piece's gather stays exposed, so four leave a
/// quarter of it.
const NCCL_CUT: Cut = Cut {
    min_bytes: 64 << 20,
    max_pieces: 4,
};
/// Pieces start on multiples of this many tokens, whole pages of any power-of-two page size up
/// to it, so a paged shard is gathered page by page.
const PIECE_ALIGN: usize = 1024;

/// The logical token ranges a hand-off of `tokens` tokens of `token_bytes` each (K or V) is
/// sent in, cut by `cut`. The sender and the receiver cut alike, from the same numbers, so each
/// piece sent meets the next rank's receive; no tokens is one empty piece.
pub(crate) fn hand_off_pieces(tokens: usize, token_bytes: usize, cut: Cut) -> Vec<Range<usize>> {
    let pieces = (tokens * token_bytes / cut.min_bytes).clamp(1, cut.max_pieces);
    let per = tokens.div_ceil(pieces).next_multiple_of(PIECE_ALIGN).max(1);
    let mut out: Vec<Range<usize>> = (0..pieces)
        .map(|i| (i * per).min(tokens)..((i + 1) * per).min(tokens))
        .filter(|r| !r.is_empty())
        .collect();
    if out.is_empty() {
        out.push(0..0);
    }
    out
}

/// Bytes of K (or V) of logical tokens `0..tokens` of `kv`, which NCCL moves in one piece:
/// contiguous storage only (paged KV travels through a host transport or `DeviceWorld`).
fn contiguous_bytes(op: &str, kv: &CudaKv, tokens: usize) -> Result<usize> {
    if kv.paging.is_some() {
        return Err(CudaError::Unsupported(format!(
            "{op} over NCCL needs contiguous KV, not paged; run without paging"
        )));
    }
    if tokens > kv.tokens {
        return Err(CudaError::Unsupported(format!(
            "{op}: {tokens} tokens of KV that holds {}; size the receiving KV for the largest shard",
            kv.tokens
        )));
    }
    Ok(kv.bytes_of(tokens))
}

impl<H: Collective> Group for NcclTransport<'_, H> {
    fn rank(&self) -> usize {
        self.world.rank()
    }

    fn size(&self) -> usize {
        self.world.size()
    }
}

/// Host collectives, by the host collective the ranks were started with; traffic adds
/// NCCL's.
impl<H: Collective> HostPart for NcclTransport<'_, H> {
    type Host = H;
    fn host(&self) -> &H {
        self.host
    }

    fn own_traffic(&self) -> Traffic {
        Traffic {
            bytes: self.wire_bytes(),
            calls: 0,
        }
    }
}

impl<H: Collective> Transport<CudaBackend> for NcclTransport<'_, H> {
    fn all_reduce_buf(
        &self,
        b: &CudaBackend,
        buf: &mut CudaSlice<f32>,
        range: Range<usize>,
        op: ReduceOp,
    ) -> EResult<()> {
        expect_room("cuda", "all_reduce_buf", buf.len(), range.end)?;
        let name = match op {
            ReduceOp::Sum => "all_reduce(sum)",
            ReduceOp::Max => "all_reduce(max)",
        };
        Ok(self.on_world(b, |w| {
            w.all_reduce_in_place(name, &mut buf.slice_mut(range), nccl_op(op))
        })?)
    }

    fn reduce_scatter_buf(
        &self,
        b: &CudaBackend,
        buf: &mut CudaSlice<f32>,
        range: Range<usize>,
        op: ReduceOp,
    ) -> EResult<()> {
        expect_room("cuda", "reduce_scatter_buf", buf.len(), range.end)?;
        let name = match op {
            ReduceOp::Sum => "reduce_scatter(sum)",
            ReduceOp::Max => "reduce_scatter(max)",
        };
        Ok(self.on_world(b, |w| {
            w.reduce_scatter_in_place(name, &mut buf.slice_mut(range), nccl_op(op))
        })?)
    }

    fn all_gather_buf(
        &self,
        b: &CudaBackend,
        src: &CudaSlice<f32>,
        len: usize,
        dst: &mut CudaSlice<f32>,
    ) -> EResult<()> {
        let p = self.size();
        expect_room("cuda", "all_gather_buf", src.len(), len)?;
        expect_room("cuda", "all_gather_buf", dst.len(), len * p)?;
        Ok(self.on_world(b, |w| {
            w.all_gather(
                "all_gather",
                &src.slice(0..len),
                &mut dst.slice_mut(0..len * p),
            )
        })?)
    }

    /// In one kernel over the peers' mapped memory where every rank's GPU reaches every
    /// other's (the `peer_merge` module); else NCCL's all-gather, between the states' packing and
    /// their fold.
    fn gather_merge(&self, b: &CudaBackend, states: &mut CudaStates) -> EResult<bool> {
        self.world.note_call("the peer merge");
        Ok(self.peer.merge(self.host, b, states)?)
    }

    fn send_buf(
        &self,
        b: &CudaBackend,
        buf: &CudaSlice<f32>,
        range: Range<usize>,
        peer: usize,
    ) -> EResult<()> {
        expect_room("cuda", "send_buf", buf.len(), range.end)?;
        Ok(self.on_world(b, |w| w.send("send", &buf.slice(range), peer))?)
    }

    fn recv_buf(
        &self,
        b: &CudaBackend,
        buf: &mut CudaSlice<f32>,
        range: Range<usize>,
        peer: usize,
    ) -> EResult<()> {
        expect_room("cuda", "recv_buf", buf.len(), range.end)?;
        Ok(self.on_world(b, |w| w.recv("recv", &mut buf.slice_mut(range), peer))?)
    }

    fn send_kv(&self, b: &CudaBackend, kv: &CudaKv, tokens: usize, peer: usize) -> EResult<()> {
        let n = contiguous_bytes("send_kv", kv, tokens)?;
        Ok(self.on_world(b, |w| {
            w.send("send(K)", &kv.k.slice(0..n), peer)?;
            w.send("send(V)", &kv.v.slice(0..n), peer)
        })?)
    }

    fn recv_kv(&self, b: &CudaBackend, kv: &mut CudaKv, tokens: usize, peer: usize) -> EResult<()> {
        let n = contiguous_bytes("recv_kv", kv, tokens)?;
        Ok(self.on_world(b, |w| {
            w.recv("recv(K)", &mut kv.k.slice_mut(0..n), peer)?;
            w.recv("recv(V)", &mut kv.v.slice_mut(0..n), peer)
        })?)
    }

    /// The leader receives every member's part as one group on the node communicator.
    fn gather_in_node(
        &self,
        _b: &CudaBackend,
        layout: &NodeLayout,
        buf: &mut CudaSlice<f32>,
        len: usize,
    ) -> EResult<()> {
        self.check_layout(layout)?;
        let node = self.node()?;
        let n = node.size();
        expect_room("cuda", "gather_in_node", buf.len(), n * len)?;
        if node.rank() != 0 {
            return Ok(node.send("send(node leader)", &buf.slice(0..len), 0)?);
        }
        Ok(group(node.rank(), || {
            (1..n).try_for_each(|i| {
                node.recv(
                    "recv(node member)",
                    &mut buf.slice_mut(i * len..(i + 1) * len),
                    i,
                )
            })
        })?)
    }

    fn all_gather_leaders(
        &self,
        _b: &CudaBackend,
        layout: &NodeLayout,
        buf: &mut CudaSlice<f32>,
        len: usize,
    ) -> EResult<()> {
        self.check_layout(layout)?;
        let leaders = self.leaders.as_ref().ok_or_else(|| {
            CudaError::Unsupported(format!(
                "rank {} joined the leaders' exchange without the leaders' communicator",
                self.rank()
            ))
        })?;
        Ok(leaders.all_gather_in_place("all_gather(leaders)", buf, len)?)
    }

    fn broadcast_in_node(
        &self,
        _b: &CudaBackend,
        layout: &NodeLayout,
        buf: &mut CudaSlice<f32>,
        len: usize,
    ) -> EResult<()> {
        self.check_layout(layout)?;
        let node = self.node()?;
        if node.size() == 1 {
            return Ok(());
        }
        expect_room("cuda", "broadcast_in_node", buf.len(), len)?;
        Ok(node.broadcast_in_place("broadcast(node)", &mut buf.slice_mut(0..len), 0)?)
    }

    /// Enqueues the hand-off once the compute stream is done with `recv` (everything enqueued
    /// on it so far), and records its arrival: on the copy engines over the peers' memory where
    /// every rank maps every other's (the `peer_ring` module), else through NCCL on the world's
    /// stream, where paged KV goes through contiguous buffers and contiguous KV moves in place
    /// (`NcclTransport::start_hand_off`).
    fn start_kv_exchange(
        &self,
        b: &CudaBackend,
        send: &CudaKv,
        send_tokens: usize,
        recv: &mut CudaKv,
        recv_tokens: usize,
    ) -> EResult<()> {
        self.world.note_call("the ring's copy-engine hand-off");
        let idle = |e: &CudaEvent| self.wait_event(e);
        let hop = self
            .ring
            .start(self.host, b, (send, send_tokens), (recv, recv_tokens), idle)?;
        let (staged, arrived) = match hop {
            Some(hop) => (
                Staged {
                    sent: hop.gathered,
                    arriving: None,
                    tokens: recv_tokens,
                },
                hop.done,
            ),
            None => (
                self.start_hand_off(b, send, send_tokens, recv, recv_tokens)?,
                record(self.world.stream())?,
            ),
        };
        *self.staged.borrow_mut() = Some(staged);
        *self.arrived.borrow_mut() = Some(arrived);
        Ok(())
    }

    /// The compute stream waits for the hand-off's arrival (the host does not), then scatters
    /// a paged hand-off into `recv`; its buffers are freed in the compute stream's order.
    fn finish_kv_exchange(
        &self,
        b: &CudaBackend,
        recv: &mut CudaKv,
        _recv_tokens: usize,
    ) -> EResult<()> {
        let arrived = self.arrived.borrow_mut().take().ok_or_else(|| {
            CudaError::Unsupported("finish_kv_exchange without a hand-off started".into())
        })?;
        b.stream().wait(&arrived).ctx("cuStreamWaitEvent")?;
        if let Some(staged) = self.staged.borrow_mut().take() {
            if let (Some((k, v)), 1..) = (&staged.arriving, staged.tokens) {
                b.scatter_device(recv, 0, staged.tokens, k, v)?;
            }
            // The shard sent lives until the compute stream has waited for the hand-off.
            drop(staged.sent);
        }
        Ok(())
    }

    /// The tree's communicators enqueue on the compute stream ([`NcclTransport::new`]); the
    /// ring's world has a stream of its own.
    fn merges_on_stream(&self, b: &CudaBackend) -> bool {
        self.world.stream().cu_stream() == b.stream().cu_stream()
    }

    fn agree_max(&self, vote: u8) -> EResult<u8> {
        let mut votes = [vote];
        self.host.all_reduce(&mut votes, ReduceOp::Max)?;
        Ok(votes[0])
    }

    fn wait(&self, b: &CudaBackend) -> EResult<()> {
        self.wait_event(&record(b.stream())?)?;
        let world = self.world.stream();
        if world.cu_stream() != b.stream().cu_stream() {
            self.wait_event(&record(world)?)?;
        }
        Ok(())
    }

    /// CUDA events on the compute stream around each step, every step enqueued before any is
    /// waited for; the wait for the last goes through the watchdog.
    fn time_steps(
        &self,
        b: &CudaBackend,
        warmup: usize,
        iters: usize,
        cache: Cache,
        step: &mut dyn FnMut() -> EResult<()>,
    ) -> EResult<Vec<f64>> {
        for _ in 0..warmup {
            step()?;
        }
        b.time_ms_until(iters, cache, |e| self.wait_event(e), step)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::{prop_oneof, Just, Strategy as _};

    /// Ids survive their trip through bytes, in their places; a truncated message is refused.
    #[test]
    fn ids_round_trip_through_bytes() {
        let bytes: Vec<u8> = (0..NcclIds::byte_len(3))
            .map(|i| (i * 7 % 251) as u8)
            .collect();
        let ids = NcclIds::from_bytes(&bytes).expect("five ids");
        assert_eq!(ids.nodes.len(), 3);
        assert_eq!(ids.to_bytes(), bytes);
        assert_eq!(ids.leaders.internal()[0] as u8, bytes[4 * ID_BYTES]);
        assert!(NcclIds::from_bytes(&bytes[..bytes.len() - 1]).is_err());
        assert!(NcclIds::from_bytes(&bytes[..ID_BYTES]).is_err());
    }

    proptest::proptest! {
        /// A hand-off's pieces cover its tokens in order, without gaps or overlap, start on
        /// whole pages, are at most the cut's count, and are cut only where each carries the
        /// cut's bytes or more but the last; NCCL's cut and the copy engines' alike.
        #[test]
        fn hand_off_pieces_cover_the_shard_in_order(
            tokens in 0usize..1 << 22,
            token_bytes in prop_oneof![Just(16usize), Just(128), 1usize..4096],
            cut in prop_oneof![
                Just(NCCL_CUT),
                Just(crate::peer_ring::PEER_CUT),
                (1usize..1 << 24, 1usize..12).prop_map(|(min_bytes, max_pieces)| Cut { min_bytes, max_pieces }),
            ],
        ) {
            let pieces = hand_off_pieces(tokens, token_bytes, cut);
            proptest::prop_assert!(!pieces.is_empty() && pieces.len() <= cut.max_pieces);
            proptest::prop_assert_eq!(pieces[0].start, 0);
            proptest::prop_assert_eq!(pieces[pieces.len() - 1].end, tokens);
            for w in pieces.windows(2) {
                proptest::prop_assert_eq!(w[0].end, w[1].start);
                proptest::prop_assert!(w[1].start.is_multiple_of(PIECE_ALIGN));
            }
            if pieces.len() > 1 {
                for p in &pieces[..pieces.len() - 1] {
                    proptest::prop_assert!(p.len() * token_bytes >= cut.min_bytes);
                }
            }
            if tokens * token_bytes < 2 * cut.min_bytes {
                proptest::prop_assert_eq!(pieces.len(), 1);
            }
        }
    }
}
