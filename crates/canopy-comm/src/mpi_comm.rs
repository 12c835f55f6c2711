//! Ranks as MPI processes (`mpirun -np P canopy … --launcher mpi`).

use crate::{fold_rank_order, Collective, CommError, Element, Group, ReduceOp, Result, Traffic};
use mpi::environment::Universe;
use mpi::point_to_point::{Destination, Source};
use mpi::request::{Request, StaticScope};
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::traits::CommunicatorCollectives;
use std::cell::{Cell, RefCell};

/// A send in flight: the request and the copy of the data it reads (freed once it completes).
struct PendingSend {
    request: Request<'static, [u8], StaticScope>,
    data: *mut [u8],
}

/// This process's rank in the MPI world.
pub struct MpiComm {
    /// Keeps MPI initialised for as long as the communicator lives.
    _universe: Universe,
    world: SimpleCommunicator,
    /// Sends are non-blocking copies, so a ring's send-then-receive cannot deadlock (as with
    /// NCCL's grouped send/recv). They are completed before a collective or a barrier, not in
    /// `recv`: waiting there for the neighbour to receive would chain waits around the ring.
    pending: RefCell<Vec<PendingSend>>,
    bytes: Cell<u64>,
    calls: Cell<u64>,
}

impl MpiComm {
    /// Initialises MPI (once per process).
    pub fn init() -> Result<MpiComm> {
        let universe = mpi::initialize()
            .ok_or_else(|| CommError::Mpi("MPI is already initialised in this process".into()))?;
        let world = universe.world();
        Ok(MpiComm {
            _universe: universe,
            world,
            pending: RefCell::new(Vec::new()),
            bytes: Cell::new(0),
            calls: Cell::new(0),
        })
    }

    /// Waits for every send in flight and frees its data.
    fn complete_sends(&self) {
        for send in self.pending.borrow_mut().drain(..) {
            send.request.wait();
            // SAFETY: `data` came from Box::into_raw in `send`, and its only reader, the
            // request, has completed.
            drop(unsafe { Box::from_raw(send.data) });
        }
    }

    /// This process's rank among the ranks of its node (`MPI_Comm_split_type` shared memory):
    /// the GPU a rank drives.
    pub fn local_rank(&self) -> usize {
        self.world.split_shared(0).rank() as usize
    }

    /// The most ranks any one node holds (collective: every rank calls it), which is what
    /// decides how many ranks share the busiest node's GPUs.
    pub fn busiest_node_ranks(&self) -> Result<usize> {
        let mut ranks = [self.local_rank() as u64 + 1];
        self.all_reduce(&mut ranks, ReduceOp::Max)?;
        Ok(ranks[0] as usize)
    }

    fn count(&self, bytes: u64) {
        self.bytes.set(self.bytes.get() + bytes);
        self.calls.set(self.calls.get() + 1);
    }

    fn check_peer(&self, peer: usize) -> Result<()> {
        if peer >= self.size() {
            return Err(CommError::BadPeer {
                rank: self.rank(),
                peer,
                size: self.size(),
            });
        }
        Ok(())
    }
}

impl Drop for MpiComm {
    fn drop(&mut self) {
        self.complete_sends();
    }
}

impl Group for MpiComm {
    fn rank(&self) -> usize {
        self.world.rank() as usize
    }

    fn size(&self) -> usize {
        self.world.size() as usize
    }
}

impl Collective for MpiComm {
    fn host_name(&self) -> Result<String> {
        mpi::environment::processor_name()
            .map_err(|e| CommError::Mpi(format!("MPI_Get_processor_name failed: {e:?}")))
    }

    fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.complete_sends();
        let p = self.size();
        let mine: &[u8] = bytemuck::cast_slice(buf);
        let mut all = vec![0u8; mine.len() * p];
        self.world.all_gather_into(mine, &mut all[..]);
        let len = mine.len();
        fold_rank_order(buf, all.chunks(len.max(1)).take(p), op);
        self.count(2 * (p as u64 - 1) * len as u64 / p as u64);
        Ok(())
    }

    /// An all-to-all of the blocks, each rank folding every rank's copy of its own in rank
    /// order, as [`MpiComm::all_reduce`] folds every element.
    fn reduce_scatter<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.complete_sends();
        let p = self.size();
        crate::check_blocks(self.rank(), buf.len(), p)?;
        let all: &[u8] = bytemuck::cast_slice(buf);
        let block = all.len() / p;
        let mut theirs = vec![0u8; all.len()];
        self.world.all_to_all_into(all, &mut theirs[..]);
        let mine = buf.len() / p * self.rank()..buf.len() / p * (self.rank() + 1);
        fold_rank_order(&mut buf[mine], theirs.chunks(block.max(1)).take(p), op);
        self.count((p as u64 - 1) * (block * p) as u64 / p as u64);
        Ok(())
    }

    fn all_gather<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        self.complete_sends();
        let p = self.size();
        crate::check_gather_len(self.rank(), send.len(), recv.len(), p)?;
        let recv_bytes: &mut [u8] = bytemuck::cast_slice_mut(recv);
        self.world
            .all_gather_into(bytemuck::cast_slice::<T, u8>(send), recv_bytes);
        self.count(std::mem::size_of_val(recv) as u64 * (p as u64 - 1) / p as u64);
        Ok(())
    }

    fn send<T: Element>(&self, buf: &[T], peer: usize) -> Result<()> {
        self.check_peer(peer)?;
        let data: *mut [u8] = Box::into_raw(
            bytemuck::cast_slice::<T, u8>(buf)
                .to_vec()
                .into_boxed_slice(),
        );
        // SAFETY: the copy lives until `complete_sends` waits for this request and frees it.
        let static_data: &'static [u8] = unsafe { &*data };
        let request = self
            .world
            .process_at_rank(peer as i32)
            .immediate_send(StaticScope, static_data);
        self.pending
            .borrow_mut()
            .push(PendingSend { request, data });
        self.count(static_data.len() as u64);
        Ok(())
    }

    fn recv<T: Element>(&self, buf: &mut [T], peer: usize) -> Result<()> {
        self.check_peer(peer)?;
        let want = std::mem::size_of_val(buf);
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(buf);
        let status = self.world.process_at_rank(peer as i32).receive_into(bytes);
        let got = status.count(<u8 as mpi::datatype::Equivalence>::equivalent_datatype()) as usize;
        crate::check_bytes(self.rank(), "recv", format_args!("peer {peer}"), got, want)
    }

    fn barrier(&self) -> Result<()> {
        self.complete_sends();
        self.world.barrier();
        Ok(())
    }

    fn traffic(&self) -> Traffic {
        Traffic {
            bytes: self.bytes.get(),
            calls: self.calls.get(),
        }
    }
}
