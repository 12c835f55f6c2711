//! NCCL communicators that can be watched and aborted.
//!
//! cudarc's safe `Comm` hides its raw handle, and without it there is no
//! `ncclCommGetAsyncError` and no `ncclCommAbort`: a peer that dies leaves the others spinning
//! inside an NCCL kernel for ever. [`NcclComm`] keeps the handle, names the last call it
//! enqueued, and counts the bytes it sends with the ring-algorithm formulas of
//! [`canopy_engine::cost`]. [`Watchdog`] is how a rank waits for its stream: it polls the
//! stream's event and every communicator's asynchronous error (aborting the communicators on
//! an error), and a monitor thread ends the process, naming the rank and the call, when the
//! rank makes no progress for the configured timeout.

use crate::error::{CudaError, DriverContext, Result};
use canopy_engine::cost::{Call, CallKind};
use cudarc::driver::{CudaEvent, CudaStream, DevicePtr, DevicePtrMut};
use cudarc::nccl::{result, sys, Id, NcclType};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The reductions the merges use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NcclOp {
    Sum,
    Max,
}

impl NcclOp {
    fn raw(self) -> sys::ncclRedOp_t {
        match self {
            NcclOp::Sum => sys::ncclRedOp_t::ncclSum,
            NcclOp::Max => sys::ncclRedOp_t::ncclMax,
        }
    }
}

/// Makes NCCL connect peers while the communicator is created (`NCCL_RUNTIME_CONNECT=0`)
/// instead of inside the first collective call. Lazily connecting calls block the host until
/// every peer answers, so a dead peer would hang the rank before its watchdog could run; at
/// creation every rank is known to be present. A value the user set is kept. Call before any
/// thread creates a communicator.
pub fn connect_at_init() {
    if std::env::var_os("NCCL_RUNTIME_CONNECT").is_none() {
        std::env::set_var("NCCL_RUNTIME_CONNECT", "0");
    }
}

/// One rank's NCCL communicator, with its calls enqueued on `stream`.
pub struct NcclComm {
    raw: sys::ncclComm_t,
    stream: Arc<CudaStream>,
    rank: usize,
    size: usize,
    /// The last call enqueued: what a stalled rank was waiting in.
    last: Cell<&'static str>,
    wire_bytes: Cell<u64>,
    aborted: Cell<bool>,
}

impl NcclComm {
    /// Joins communicator `id` as `rank` of `size`; blocks until every rank has joined.
    pub fn new(stream: Arc<CudaStream>, rank: usize, size: usize, id: &Id) -> Result<NcclComm> {
        // NCCL joins the calling thread's current device: the stream's, whichever thread made
        // its context.
        stream.context().bind_to_thread().ctx("cuCtxSetCurrent")?;
        let mut raw = std::ptr::null_mut();
        let unique = sys::ncclUniqueId {
            internal: *id.internal(),
        };
        // SAFETY: `raw` is a valid out-pointer; rank < size is NCCL's to check.
        unsafe { result::comm_init_rank(&mut raw, size as i32, unique, rank as i32) }
            .map_err(|e| nccl_error(rank, "ncclCommInitRank", e))?;
        Ok(NcclComm {
            raw,
            stream,
            rank,
            size,
            last: Cell::new("ncclCommInitRank"),
            wire_bytes: Cell::new(0),
            aborted: Cell::new(false),
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn size(&self) -> usize {
        self.size
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Bytes sent so far, by the ring-algorithm formulas.
    pub fn wire_bytes(&self) -> u64 {
        self.wire_bytes.get()
    }

    /// Names a call of this communicator's ranks made outside NCCL (the peer merge), so that
    /// the watchdog names it if a peer never answers.
    pub(crate) fn note_call(&self, name: &'static str) {
        self.last.set(name);
    }

    fn enqueue(
        &self,
        name: &'static str,
        call: Option<Call>,
        f: impl FnOnce(sys::cudaStream_t) -> Result<result::NcclStatus, result::NcclError>,
    ) -> Result<()> {
        self.last.set(name);
        f(self.stream.cu_stream() as sys::cudaStream_t)
            .map_err(|e| nccl_error(self.rank, name, e))?;
        let bytes = call.map_or(0, |c| c.wire_bytes());
        self.wire_bytes.set(self.wire_bytes.get() + bytes);
        Ok(())
    }

    fn call(&self, kind: CallKind, elems: usize, elem_bytes: usize) -> Option<Call> {
        Some(Call {
            kind,
            group: self.size,
            payload_bytes: (elems * elem_bytes) as u64,
        })
    }

    pub fn all_reduce_in_place<T: NcclType, B: DevicePtrMut<T>>(
        &self,
        name: &'static str,
        buf: &mut B,
        op: NcclOp,
    ) -> Result<()> {
        let n = buf.len();
        let (ptr, _sync) = buf.device_ptr_mut(&self.stream);
        let call = self.call(CallKind::AllReduce, n, std::mem::size_of::<T>());
        // SAFETY: `ptr` holds `n` elements of T on this communicator's device.
        self.enqueue(name, call, |s| unsafe {
            result::all_reduce(
                ptr as _,
                ptr as _,
                n,
                T::as_nccl_type(),
                op.raw(),
                self.raw,
                s,
            )
        })
    }

    /// In place: `buf` holds `size()` blocks; this rank's block (at `rank()` · `len / size()`)
    /// ends with every rank's block reduced, and the others are left as they were.
    pub fn reduce_scatter_in_place<T: NcclType, B: DevicePtrMut<T>>(
        &self,
        name: &'static str,
        buf: &mut B,
        op: NcclOp,
    ) -> Result<()> {
        let n = buf.len();
        if !n.is_multiple_of(self.size) {
            return Err(CudaError::Unsupported(format!(
                "rank {}: {name} needs a buffer of {} equal blocks, got {n} elements",
                self.rank, self.size
            )));
        }
        let count = n / self.size;
        let (ptr, _sync) = buf.device_ptr_mut(&self.stream);
        let mine = ptr + (self.rank * count * std::mem::size_of::<T>()) as u64;
        let call = self.call(CallKind::ReduceScatter, n, std::mem::size_of::<T>());
        // SAFETY: `buf` holds size × count elements on this device; this rank's block starts
        // at `mine`, inside it (NCCL's in-place form).
        self.enqueue(name, call, |s| unsafe {
            result::reduce_scatter(
                ptr as _,
                mine as _,
                count,
                T::as_nccl_type(),
                op.raw(),
                self.raw,
                s,
            )
        })
    }

    /// Sums into rank `root`'s `buf` (others' buffers are left as they were).
    pub fn reduce_in_place<T: NcclType, B: DevicePtrMut<T>>(
        &self,
        name: &'static str,
        buf: &mut B,
        op: NcclOp,
        root: usize,
    ) -> Result<()> {
        let n = buf.len();
        let (ptr, _sync) = buf.device_ptr_mut(&self.stream);
        let call = self.call(CallKind::Reduce, n, std::mem::size_of::<T>());
        // SAFETY: as in `all_reduce_in_place`.
        self.enqueue(name, call, |s| unsafe {
            result::reduce(
                ptr as _,
                ptr as _,
                n,
                T::as_nccl_type(),
                op.raw(),
                root as i32,
                self.raw,
                s,
            )
        })
    }

    pub fn broadcast_in_place<T: NcclType, B: DevicePtrMut<T>>(
        &self,
        name: &'static str,
        buf: &mut B,
        root: usize,
    ) -> Result<()> {
        let n = buf.len();
        let (ptr, _sync) = buf.device_ptr_mut(&self.stream);
        let call = self.call(CallKind::Broadcast, n, std::mem::size_of::<T>());
        // SAFETY: as in `all_reduce_in_place`.
        self.enqueue(name, call, |s| unsafe {
            result::broadcast(
                ptr as _,
                ptr as _,
                n,
                T::as_nccl_type(),
                root as i32,
                self.raw,
                s,
            )
        })
    }

    /// `recv` holds `size()` copies of `send`, in rank order.
    pub fn all_gather<T: NcclType, S: DevicePtr<T>, R: DevicePtrMut<T>>(
        &self,
        name: &'static str,
        send: &S,
        recv: &mut R,
    ) -> Result<()> {
        let n = send.len();
        if recv.len() != n * self.size {
            return Err(CudaError::Unsupported(format!(
                "rank {}: {name} needs a receive buffer of {} elements, got {}",
                self.rank,
                n * self.size,
                recv.len()
            )));
        }
        let (src, _s) = send.device_ptr(&self.stream);
        let (dst, _r) = recv.device_ptr_mut(&self.stream);
        let call = self.call(CallKind::AllGather, n, std::mem::size_of::<T>());
        // SAFETY: `src` holds n elements and `dst` n × size, both on this device.
        self.enqueue(name, call, |s| unsafe {
            result::all_gather(src as _, dst as _, n, T::as_nccl_type(), self.raw, s)
        })
    }

    /// In place: `buf` holds `size()` parts of `count` elements, this rank's at
    /// `rank() * count`; every rank ends with every part.
    pub fn all_gather_in_place<T: NcclType, B: DevicePtrMut<T>>(
        &self,
        name: &'static str,
        buf: &mut B,
        count: usize,
    ) -> Result<()> {
        if buf.len() < count * self.size {
            return Err(CudaError::Unsupported(format!(
                "rank {}: {name} needs a buffer of {} elements, got {}",
                self.rank,
                count * self.size,
                buf.len()
            )));
        }
        let (ptr, _sync) = buf.device_ptr_mut(&self.stream);
        let mine = ptr + (self.rank * count * std::mem::size_of::<T>()) as u64;
        let call = self.call(CallKind::AllGather, count, std::mem::size_of::<T>());
        // SAFETY: `buf` holds size × count elements on this device; this rank's part starts
        // at `mine`, inside it (NCCL's in-place form).
        self.enqueue(name, call, |s| unsafe {
            result::all_gather(mine as _, ptr as _, count, T::as_nccl_type(), self.raw, s)
        })
    }

    pub fn send<T: NcclType, S: DevicePtr<T>>(
        &self,
        name: &'static str,
        buf: &S,
        peer: usize,
    ) -> Result<()> {
        let n = buf.len();
        let (ptr, _sync) = buf.device_ptr(&self.stream);
        self.enqueue(name, None, |s| unsafe {
            // SAFETY: `ptr` holds n elements on this device.
            result::send(ptr as _, n, T::as_nccl_type(), peer as i32, self.raw, s)
        })?;
        self.wire_bytes
            .set(self.wire_bytes.get() + (n * std::mem::size_of::<T>()) as u64);
        Ok(())
    }

    pub fn recv<T: NcclType, R: DevicePtrMut<T>>(
        &self,
        name: &'static str,
        buf: &mut R,
        peer: usize,
    ) -> Result<()> {
        let n = buf.len();
        let (ptr, _sync) = buf.device_ptr_mut(&self.stream);
        self.enqueue(name, None, |s| unsafe {
            // SAFETY: `ptr` has room for n elements on this device.
            result::recv(ptr as _, n, T::as_nccl_type(), peer as i32, self.raw, s)
        })
    }

    /// An error NCCL raised asynchronously (a failed peer or network), if any.
    pub fn check_async(&self) -> Result<()> {
        let mut state = sys::ncclResult_t::ncclSuccess;
        // SAFETY: `raw` is a live communicator and `state` a valid out-pointer.
        unsafe { sys::ncclCommGetAsyncError(self.raw, &mut state) }
            .result()
            .map_err(|e| nccl_error(self.rank, "ncclCommGetAsyncError", e))?;
        match state {
            sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress => Ok(()),
            other => Err(nccl_error(
                self.rank,
                self.last.get(),
                result::NcclError(other),
            )),
        }
    }

    /// Aborts every operation in flight and frees the communicator.
    pub fn abort(&self) {
        if !self.aborted.replace(true) {
            // SAFETY: `raw` is live and not used again after this.
            let _ = unsafe { result::comm_abort(self.raw) };
        }
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        // Abort rather than destroy: it never waits on peers that may be gone.
        self.abort();
    }
}

/// Runs `f` between `ncclGroupStart` and `ncclGroupEnd`, so its calls proceed together.
pub fn group(rank: usize, f: impl FnOnce() -> Result<()>) -> Result<()> {
    result::group_start().map_err(|e| nccl_error(rank, "ncclGroupStart", e))?;
    let inner = f();
    let end = result::group_end().map_err(|e| nccl_error(rank, "ncclGroupEnd", e));
    inner.and(end.map(|_| ()))
}

fn nccl_error(rank: usize, call: &'static str, e: result::NcclError) -> CudaError {
    CudaError::Nccl {
        rank,
        call,
        detail: format!("{:?}", e.0),
    }
}

/// How long a rank may make no progress once another rank of this process has failed.
const AFTER_A_FAILURE: Duration = Duration::from_secs(10);

/// A failure one rank of this process reported, for the other ranks' watchdog messages.
static FAILURE: Mutex<Option<String>> = Mutex::new(None);

/// Records that a rank of this process failed with `message`.
fn note_failure(message: String) {
    let mut f = FAILURE.lock().unwrap_or_else(|p| p.into_inner());
    f.get_or_insert(message);
}

/// `out`, rank `rank`'s result, noted first if it failed: its peers may be waiting in
/// collectives it will never join, and their watchdogs then end the process soon, with this
/// failure in their message.
pub fn noting_failure<T, E: std::fmt::Display>(rank: usize, out: Result<T, E>) -> Result<T, E> {
    if let Err(e) = &out {
        note_failure(format!("rank {rank} failed: {e:#}"));
    }
    out
}

/// What a rank last did: when and in which NCCL call.
struct Progress {
    at: Instant,
    call: &'static str,
}

/// A rank's stall detector. [`wait`](Self::wait) polls the stream and the communicators'
/// asynchronous errors; a monitor thread ends the process when no wait has completed for
/// `timeout` (a peer that died leaves NCCL kernels, and sometimes NCCL host calls, waiting for
/// ever, so the rank itself cannot be relied on to notice). Ending the process is what frees a
/// GPU held by a spinning kernel; under mpirun it also ends the job.
pub struct Watchdog {
    timeout: Duration,
    progress: Arc<Mutex<Progress>>,
    stop: Arc<AtomicBool>,
}

impl Watchdog {
    pub fn start(rank: usize, timeout: Duration) -> Watchdog {
        let progress = Arc::new(Mutex::new(Progress {
            at: Instant::now(),
            call: "its first step (not yet enqueued)",
        }));
        let stop = Arc::new(AtomicBool::new(false));
        let (p, s) = (progress.clone(), stop.clone());
        std::thread::spawn(move || loop {
            std::thread::sleep(Duration::from_millis(20));
            if s.load(Ordering::Relaxed) {
                return;
            }
            let (idle, call) = {
                let g = p.lock().unwrap_or_else(|e| e.into_inner());
                (g.at.elapsed(), g.call)
            };
            let failure = FAILURE.lock().unwrap_or_else(|e| e.into_inner()).clone();
            // Once a rank of this process has failed, its peers' collectives cannot complete:
            // a stalled rank waits the grace, not the whole timeout.
            let limit = match failure {
                Some(_) => timeout.min(AFTER_A_FAILURE),
                None => timeout,
            };
            if idle > limit {
                let cause = failure.map_or(String::new(), |f| format!("; {f}"));
                eprintln!(
                    "error: {}{cause}",
                    CudaError::Watchdog {
                        rank,
                        call,
                        secs: idle.as_secs_f64()
                    }
                );
                // Not `process::exit`: its exit handlers (the CUDA driver's, NCCL's) wait for
                // the very kernels that are stuck.
                // SAFETY: `_exit` ends the process at once; nothing after it runs.
                unsafe { libc::_exit(1) };
            }
        });
        Watchdog {
            timeout,
            progress,
            stop,
        }
    }

    fn mark(&self, call: &'static str, done: bool) {
        let mut g = self.progress.lock().unwrap_or_else(|e| e.into_inner());
        g.call = call;
        if done {
            g.at = Instant::now();
        }
    }

    /// Waits until `event` completes; fails, aborting every communicator in `comms`, on an
    /// asynchronous NCCL error. Each completed wait counts as progress.
    pub fn wait(&self, event: &CudaEvent, comms: &[&NcclComm]) -> Result<()> {
        self.mark(comms.first().map_or("a kernel", |c| c.last.get()), false);
        let mut pause = Duration::from_micros(1);
        loop {
            if event.is_complete() {
                event.synchronize().ctx("cuEventSynchronize")?;
                self.mark("the next step (not yet enqueued)", true);
                return Ok(());
            }
            if let Err(e) = comms.iter().try_for_each(|c| c.check_async()) {
                comms.iter().for_each(|c| c.abort());
                return Err(e);
            }
            std::thread::sleep(pause);
            pause = (pause * 2)
                .min(self.timeout / 100)
                .max(Duration::from_micros(1));
        }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}
