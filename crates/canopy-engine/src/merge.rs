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
//!
//! The algorithm is written once, in [`StatesMerge`], over two interfaces: the backend's
//! elementwise steps between collectives ([`MergeOps`]: the combine kernels on a GPU, plain
//! loops on the CPU) and a [`Transport`] that moves the backend's own buffers. Every
//! [`HostCollective`] (threads, MPI) is a transport for every backend, staging device buffers
//! through the host; a device transport (NCCL, streams of one GPU) moves them where they are.

use crate::backend::{Backend, Cache};
use crate::topology::NodeLayout;
use crate::{EngineError, Result};
use canopy_comm::{Collective, Group, ReduceOp};
use serde::Serialize;
use std::ops::Range;
use std::time::Instant;

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

/// A backend's side of the cross-rank merge: flat fp32 buffers in its memory, and the
/// elementwise steps between collectives. States are `cells = rows × heads` pairs of a
/// `head_dim` output and an lse; a packed state is `[o (cells × d) | lse (cells)]`.
pub trait MergeOps: Backend {
    /// A flat fp32 buffer in the backend's memory: what a transport moves.
    type Buf: Send;

    fn alloc_buf(&self, len: usize) -> Result<Self::Buf>;
    /// Elements `range` of `buf`, on the host.
    fn buf_to_host(&self, buf: &Self::Buf, range: Range<usize>) -> Result<Vec<f32>>;
    /// Writes `host` into `buf` from element `at`.
    fn buf_from_host(&self, host: &[f32], buf: &mut Self::Buf, at: usize) -> Result<()>;
    /// `max[..cells]` = the states' lse.
    fn copy_lse(&self, states: &Self::States, max: &mut Self::Buf) -> Result<()>;
    /// `packed = [o · w | w]`, `w = exp(lse - max)` (0 for an empty state).
    fn combine_weights(
        &self,
        states: &Self::States,
        max: &Self::Buf,
        packed: &mut Self::Buf,
    ) -> Result<()>;
    /// The normalised states of summed `packed` and `max` (empty where the sum is 0).
    fn combine_finish(
        &self,
        packed: &Self::Buf,
        max: &Self::Buf,
        states: &mut Self::States,
    ) -> Result<()>;
    /// The packed state of `states` into `buf` from element `at`.
    fn pack_states(&self, states: &Self::States, buf: &mut Self::Buf, at: usize) -> Result<()>;
    /// `states` = the fold, in order, of the first `count` packed states of `gathered`.
    fn combine_gathered(
        &self,
        gathered: &Self::Buf,
        count: usize,
        states: &mut Self::States,
    ) -> Result<()>;
    /// `acc = merge(acc, x)`, state by state.
    fn merge_into(&self, acc: &mut Self::States, x: &Self::States) -> Result<()>;
    /// Every state empty: `o = 0`, `lse = -inf`.
    fn clear_states(&self, states: &mut Self::States) -> Result<()>;
}

/// Collectives over a backend's own buffers, and the ring's KV hand-off. The calls mirror
/// NCCL's; ranges are in elements.
///
/// A transport may only enqueue its calls (a device transport puts them on a stream, in order
/// with the backend's own work): a buffer is then ready for the backend's next operation, not
/// for the host, until [`Transport::wait`]. The provided methods are written with the required
/// ones and complete each call before it returns, as the host transports do; a device
/// transport overrides them to move data where it is and to overlap (NCCL's sub-communicators
/// for the hierarchical merge's steps, its ring hand-off on a stream of its own).
pub trait Transport<B: MergeOps>: Group {
    fn all_reduce_buf(
        &self,
        b: &B,
        buf: &mut B::Buf,
        range: Range<usize>,
        op: ReduceOp,
    ) -> Result<()>;
    /// Every rank's `src[..len]` into `dst`, in rank order.
    fn all_gather_buf(&self, b: &B, src: &B::Buf, len: usize, dst: &mut B::Buf) -> Result<()>;
    /// `buf[range]` in `size()` equal blocks: this rank's block ends with the reduction of
    /// every rank's copy of it, in the bits [`Transport::all_reduce_buf`] gives there; the
    /// other blocks are left unspecified. Provided: the all-reduce of the whole range, which
    /// moves twice the bytes; a transport with a reduce-scatter of its own overrides it.
    fn reduce_scatter_buf(
        &self,
        b: &B,
        buf: &mut B::Buf,
        range: Range<usize>,
        op: ReduceOp,
    ) -> Result<()> {
        self.all_reduce_buf(b, buf, range, op)
    }
    fn send_buf(&self, b: &B, buf: &B::Buf, range: Range<usize>, peer: usize) -> Result<()>;
    fn recv_buf(&self, b: &B, buf: &mut B::Buf, range: Range<usize>, peer: usize) -> Result<()>;
    /// Logical tokens `0..tokens` of `kv` to `peer`.
    fn send_kv(&self, b: &B, kv: &B::Kv, tokens: usize, peer: usize) -> Result<()>;
    /// `tokens` tokens from `peer` into logical tokens `0..tokens` of `kv`.
    fn recv_kv(&self, b: &B, kv: &mut B::Kv, tokens: usize, peer: usize) -> Result<()>;

    /// The hierarchical merge's first step: each member of a node (`layout`) hands
    /// `buf[..len]` to its leader, which receives member `i`'s into `buf[i * len..]` (its own
    /// is slot 0, already in place).
    fn gather_in_node(
        &self,
        b: &B,
        layout: &NodeLayout,
        buf: &mut B::Buf,
        len: usize,
    ) -> Result<()> {
        let members = layout.members(layout.node_of(self.rank()));
        let leader = members[0];
        if self.rank() != leader {
            return self.send_buf(b, buf, 0..len, leader);
        }
        for (i, &m) in members.iter().enumerate().skip(1) {
            self.recv_buf(b, buf, i * len..(i + 1) * len, m)?;
        }
        Ok(())
    }

    /// Among the node leaders only: leader `i` (in [`NodeLayout::leaders`] order) holds its
    /// part in `buf[i * len..(i + 1) * len]`, and every leader ends with every part.
    fn all_gather_leaders(
        &self,
        b: &B,
        layout: &NodeLayout,
        buf: &mut B::Buf,
        len: usize,
    ) -> Result<()> {
        let leaders = layout.leaders();
        let me = self.rank();
        let mine = leaders.iter().position(|&l| l == me).ok_or_else(|| {
            EngineError::Config(format!(
                "rank {me} is no node leader but joined the leaders' exchange"
            ))
        })?;
        for &l in leaders.iter().filter(|&&l| l != me) {
            self.send_buf(b, buf, mine * len..(mine + 1) * len, l)?;
        }
        for (i, &l) in leaders.iter().enumerate().filter(|&(_, &l)| l != me) {
            self.recv_buf(b, buf, i * len..(i + 1) * len, l)?;
        }
        Ok(())
    }

    /// The hierarchical merge's last step: each leader's `buf[..len]` to its node's members.
    fn broadcast_in_node(
        &self,
        b: &B,
        layout: &NodeLayout,
        buf: &mut B::Buf,
        len: usize,
    ) -> Result<()> {
        let members = layout.members(layout.node_of(self.rank()));
        let leader = members[0];
        if self.rank() != leader {
            return self.recv_buf(b, buf, 0..len, leader);
        }
        for &m in &members[1..] {
            self.send_buf(b, buf, 0..len, m)?;
        }
        Ok(())
    }

    /// Starts one step of the ring's hand-off: logical tokens `0..send_tokens` of `send` to the
    /// next rank, and `recv_tokens` tokens from the previous rank into `recv`, which
    /// [`Transport::finish_kv_exchange`] completes. In between, the caller computes on `send`
    /// and neither writes `send` nor touches `recv`, so that a transport can move both while
    /// the backend computes. Provided: the send now, the receive at the finish.
    fn start_kv_exchange(
        &self,
        b: &B,
        send: &B::Kv,
        send_tokens: usize,
        recv: &mut B::Kv,
        recv_tokens: usize,
    ) -> Result<()> {
        let _ = (recv, recv_tokens);
        self.send_kv(b, send, send_tokens, (self.rank() + 1) % self.size())
    }

    /// Completes [`Transport::start_kv_exchange`]: `recv` holds the previous rank's tokens for
    /// the backend's next operation.
    fn finish_kv_exchange(&self, b: &B, recv: &mut B::Kv, recv_tokens: usize) -> Result<()> {
        let prev = (self.rank() + self.size() - 1) % self.size();
        self.recv_kv(b, recv, recv_tokens, prev)
    }

    /// The all-gather merge as one step of the transport's own, where it has one: every
    /// rank's `states` folded in rank order, left in `states` on every rank. `Ok(false)`
    /// where it has none, agreed by every rank (the call is collective): [`StatesMerge`] then
    /// packs the states, all-gathers them and folds them. Provided: none.
    fn gather_merge(&self, b: &B, states: &mut B::States) -> Result<bool> {
        let _ = (b, states);
        Ok(false)
    }

    /// Whether the tree's merge over this transport only enqueues work on `b`'s own stream,
    /// so that a pass running it may be recorded and replayed as one graph. NCCL's does; a
    /// host transport copies through the host in the middle of a pass. Provided: no.
    fn merges_on_stream(&self, b: &B) -> bool {
        let _ = b;
        false
    }

    /// The largest of every rank's `vote`, agreed on the host. Ranks that record their steps
    /// as graphs decide together with it: NCCL requires a collective to be captured on every
    /// rank or on none. Provided: this rank's own vote, for transports whose steps of several
    /// ranks are never recorded ([`Transport::merges_on_stream`] is false).
    fn agree_max(&self, vote: u8) -> Result<u8> {
        Ok(vote)
    }

    /// Waits until every call this rank enqueued has completed. Provided: nothing to wait for.
    fn wait(&self, b: &B) -> Result<()> {
        let _ = b;
        Ok(())
    }

    /// Milliseconds of each of `iters` runs of `step` (one decode step on this rank), after
    /// `warmup` untimed ones, timed as this world keeps time. Provided: the backend's clock
    /// ([`Backend::time_steps`]: CUDA events, every run enqueued before any is waited for;
    /// its own warm-up runs come after `warmup`). Host collectives time each run between two
    /// barriers instead.
    fn time_steps(
        &self,
        b: &B,
        warmup: usize,
        iters: usize,
        cache: Cache,
        step: &mut dyn FnMut() -> Result<()>,
    ) -> Result<Vec<f64>> {
        for _ in 0..warmup {
            step()?;
        }
        b.time_steps(iters, cache, step)
    }
}

/// A collective over host memory (threads of one process, MPI processes): it moves any
/// backend's buffers by staging them through the host. A transport that moves device buffers
/// where they are (NCCL, or streams of one GPU) implements [`Transport`] itself.
pub trait HostCollective: Collective {}

impl HostCollective for canopy_comm::ThreadComm {}
#[cfg(feature = "mpi")]
impl HostCollective for canopy_comm::MpiComm {}

impl<B: MergeOps, C: HostCollective> Transport<B> for C {
    fn all_reduce_buf(
        &self,
        b: &B,
        buf: &mut B::Buf,
        range: Range<usize>,
        op: ReduceOp,
    ) -> Result<()> {
        let mut host = b.buf_to_host(buf, range.clone())?;
        self.all_reduce(&mut host, op)?;
        b.buf_from_host(&host, buf, range.start)
    }

    fn reduce_scatter_buf(
        &self,
        b: &B,
        buf: &mut B::Buf,
        range: Range<usize>,
        op: ReduceOp,
    ) -> Result<()> {
        let mut host = b.buf_to_host(buf, range.clone())?;
        self.reduce_scatter(&mut host, op)?;
        let block = host.len() / self.size();
        let mine = self.rank() * block..(self.rank() + 1) * block;
        b.buf_from_host(&host[mine.clone()], buf, range.start + mine.start)
    }

    fn all_gather_buf(&self, b: &B, src: &B::Buf, len: usize, dst: &mut B::Buf) -> Result<()> {
        let mine = b.buf_to_host(src, 0..len)?;
        let mut all = vec![0.0f32; len * self.size()];
        self.all_gather(&mine, &mut all)?;
        b.buf_from_host(&all, dst, 0)
    }

    fn send_buf(&self, b: &B, buf: &B::Buf, range: Range<usize>, peer: usize) -> Result<()> {
        Ok(self.send(&b.buf_to_host(buf, range)?, peer)?)
    }

    fn recv_buf(&self, b: &B, buf: &mut B::Buf, range: Range<usize>, peer: usize) -> Result<()> {
        let mut host = vec![0.0f32; range.len()];
        self.recv(&mut host, peer)?;
        b.buf_from_host(&host, buf, range.start)
    }

    fn send_kv(&self, b: &B, kv: &B::Kv, tokens: usize, peer: usize) -> Result<()> {
        b.send_kv(kv, tokens, self, peer)
    }

    fn recv_kv(&self, b: &B, kv: &mut B::Kv, tokens: usize, peer: usize) -> Result<()> {
        b.recv_kv(kv, tokens, self, peer)
    }

    /// Every rank starts each run together and ends it together (a barrier on each side), on
    /// the host clock: the slowest rank's step, as a user of the whole world sees it.
    fn time_steps(
        &self,
        _b: &B,
        warmup: usize,
        iters: usize,
        _cache: Cache,
        step: &mut dyn FnMut() -> Result<()>,
    ) -> Result<Vec<f64>> {
        for _ in 0..warmup {
            step()?;
        }
        (0..iters)
            .map(|_| {
                self.barrier()?;
                let t0 = Instant::now();
                step()?;
                self.barrier()?;
                Ok(t0.elapsed().as_secs_f64() * 1e3)
            })
            .collect()
    }
}

/// The buffers of the cross-rank merge for one shape of states, allocated once.
pub struct StatesMerge<B: MergeOps> {
    cells: usize,
    d: usize,
    ranks: usize,
    max: B::Buf,
    packed: B::Buf,
    /// Every rank's packed states: only the all-gather and hierarchical merges take it, so it
    /// is allocated by the first of them (a prefill's merges of many rows never pay for it).
    gathered: Option<B::Buf>,
}

impl<B: MergeOps> StatesMerge<B> {
    /// Buffers for merging `cells` states of `d` over `ranks` ranks.
    pub fn new(backend: &B, cells: usize, d: usize, ranks: usize) -> Result<StatesMerge<B>> {
        let packed = cells * (d + 1);
        Ok(StatesMerge {
            cells,
            d,
            ranks: ranks.max(1),
            max: backend.alloc_buf(cells)?,
            packed: backend.alloc_buf(packed)?,
            gathered: None,
        })
    }

    /// Allocates the buffer of every rank's packed states on first use.
    fn ensure_gathered(&mut self, b: &B) -> Result<()> {
        if self.gathered.is_none() {
            self.gathered = Some(b.alloc_buf(self.stride() * self.ranks)?);
        }
        Ok(())
    }

    /// Elements of one packed state.
    fn stride(&self) -> usize {
        self.cells * (self.d + 1)
    }

    /// Replaces this rank's `states` with the merge of every rank's: the same bits on every
    /// rank. `how` must be concrete (`auto` is resolved first, by
    /// [`crate::cost::CostModel::choose`]); `layout` places ranks on nodes for the
    /// hierarchical form.
    pub fn run<T: Transport<B>>(
        &mut self,
        b: &B,
        comm: &T,
        states: &mut B::States,
        how: MergeCollective,
        layout: &NodeLayout,
    ) -> Result<()> {
        if comm.size() == 1 {
            return Ok(());
        }
        match how {
            MergeCollective::Allreduce3 | MergeCollective::Allreduce2 => {
                self.all_reduce_merge(b, comm, how == MergeCollective::Allreduce2, states)
            }
            MergeCollective::Allgather => {
                if comm.gather_merge(b, states)? {
                    return Ok(());
                }
                b.pack_states(states, &mut self.packed, 0)?;
                let stride = self.stride();
                self.ensure_gathered(b)?;
                let gathered = self.gathered.as_mut().expect("allocated above");
                comm.all_gather_buf(b, &self.packed, stride, gathered)?;
                b.combine_gathered(gathered, comm.size(), states)
            }
            MergeCollective::Hierarchical => {
                layout.check(comm.size())?;
                self.hierarchical(b, comm, states, layout)
            }
            MergeCollective::Auto => Err(EngineError::Config(
                "the auto collective must be resolved to a concrete one before merging".into(),
            )),
        }
    }

    /// [`StatesMerge::run`] for states whose rows each rank reads only its own block of: the
    /// states hold `size()` equal blocks of rows, and this rank's block ends merged over every
    /// rank, in the bits the all-reduce merge gives it; the other blocks are left unspecified.
    /// The lse's MAX is all-reduced (every rank weighs every block), and the numerator and
    /// denominator are reduce-scattered: of the all-reduce merge's bytes, about half cross.
    pub fn run_scattered<T: Transport<B>>(
        &mut self,
        b: &B,
        comm: &T,
        states: &mut B::States,
    ) -> Result<()> {
        let (cells, n, p) = (self.cells, self.cells * self.d, comm.size());
        if p == 1 {
            return Ok(());
        }
        if cells % p != 0 {
            return Err(EngineError::Config(format!(
                "{cells} states do not split into {p} equal blocks, one a rank"
            )));
        }
        b.copy_lse(states, &mut self.max)?;
        comm.all_reduce_buf(b, &mut self.max, 0..cells, ReduceOp::Max)?;
        b.combine_weights(states, &self.max, &mut self.packed)?;
        comm.reduce_scatter_buf(b, &mut self.packed, 0..n, ReduceOp::Sum)?;
        comm.reduce_scatter_buf(b, &mut self.packed, n..n + cells, ReduceOp::Sum)?;
        b.combine_finish(&self.packed, &self.max, states)
    }

    /// The paper's all-reduce merge: MAX of lse, then the numerator and denominator summed
    /// in one call (`fused`) or two.
    fn all_reduce_merge<T: Transport<B>>(
        &mut self,
        b: &B,
        comm: &T,
        fused: bool,
        states: &mut B::States,
    ) -> Result<()> {
        let (cells, n) = (self.cells, self.cells * self.d);
        b.copy_lse(states, &mut self.max)?;
        comm.all_reduce_buf(b, &mut self.max, 0..cells, ReduceOp::Max)?;
        b.combine_weights(states, &self.max, &mut self.packed)?;
        if fused {
            comm.all_reduce_buf(b, &mut self.packed, 0..n + cells, ReduceOp::Sum)?;
        } else {
            comm.all_reduce_buf(b, &mut self.packed, 0..n, ReduceOp::Sum)?;
            comm.all_reduce_buf(b, &mut self.packed, n..n + cells, ReduceOp::Sum)?;
        }
        b.combine_finish(&self.packed, &self.max, states)
    }

    /// Members hand their states to their node's leader, which folds the node in rank order;
    /// leaders exchange node states and fold them in node order; each leader hands the result
    /// back to its node. Every rank, leaders included, takes the result from its packed form,
    /// so all hold the same bits.
    fn hierarchical<T: Transport<B>>(
        &mut self,
        b: &B,
        comm: &T,
        states: &mut B::States,
        layout: &NodeLayout,
    ) -> Result<()> {
        let stride = self.stride();
        let me = comm.rank();
        let members = layout.members(layout.node_of(me));
        self.ensure_gathered(b)?;
        let gathered = self.gathered.as_mut().expect("allocated above");
        b.pack_states(states, gathered, 0)?;
        comm.gather_in_node(b, layout, gathered, stride)?;
        if me == members[0] {
            b.combine_gathered(gathered, members.len(), states)?;
            let leaders = layout.leaders();
            if leaders.len() > 1 {
                let slot = leaders.iter().position(|&l| l == me).unwrap_or(0) * stride;
                b.pack_states(states, gathered, slot)?;
                comm.all_gather_leaders(b, layout, gathered, stride)?;
                b.combine_gathered(gathered, leaders.len(), states)?;
            }
            b.pack_states(states, &mut self.packed, 0)?;
        }
        comm.broadcast_in_node(b, layout, &mut self.packed, stride)?;
        b.combine_gathered(&self.packed, 1, states)
    }
}
