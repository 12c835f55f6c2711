//! P ranks on one GPU: threads of one process, each with its own [`CudaBackend`] (its own
//! stream) on the device's one context, exchanging device buffers on the device.
//!
//! Why: NCCL refuses two ranks on one GPU, and the host transports ([`ThreadComm`], MPI) stage
//! every device buffer through the host, so without this a distributed path that keeps its
//! buffers on the device (the merge's collectives, the ring's KV hand-off) could only be tested
//! with several GPUs. Here every rank's buffers live in the same context, so one rank's stream
//! can copy another rank's device memory directly, and the engine's [`Transport`] runs on one
//! GPU with the same calls and the same bits as on many.
//!
//! The protocol keeps correctness simple: the host orders the ranks (the inner
//! [`ThreadComm`]'s barriers, timeouts and aborts) and every hand-over waits for the stream
//! that produced it, so no rank's stream ever reads memory another stream is still writing.
//! - **all-gather**: each rank copies its contribution into a fresh device buffer, waits for
//!   its stream, and publishes it in its slot of a shared table; barrier; each rank copies
//!   every rank's published buffer into its own output, in rank order, on its own stream,
//!   waits for it; barrier (nobody publishes the next call's buffer while a peer may still
//!   read this one); each rank clears its slot.
//! - **all-reduce**: an all-gather of the range into a `p × n` scratch, then `reduce_slots`
//!   (`combine.cu`) folds the slots in rank order into the range. Every rank folds the same
//!   bytes in the same order, so all get the same bits (and the host transports' bits: they
//!   fold in rank order too).
//! - **reduce-scatter**: the same, each rank copying and folding only its own block of every
//!   rank's range.
//! - **send / recv**: buffered mailboxes, one queue per (sender, receiver) pair. The sender
//!   copies the range into a fresh device buffer, waits for its stream, and queues it, so a
//!   send never blocks (two ranks that send to each other before receiving cannot deadlock).
//!   The receiver waits for a message (the world's timeout; an abort elsewhere wakes it),
//!   copies it into its buffer and waits for its stream before dropping the message, whose
//!   memory is freed on the sender's stream.
//! - **KV send / recv**: the same mailboxes carry K and V of logical tokens `0..tokens`,
//!   gathered from the sender's pool and scattered into the receiver's through their page
//!   tables ([`CudaBackend::gather_device`], [`CudaBackend::scatter_device`]).
//!
//! Host-side collectives (logits, the prefill ring, calibration) go to the inner
//! [`ThreadComm`] unchanged. [`DeviceComm`] is deliberately not a
//! [`canopy_engine::HostCollective`]: that would give it the host-staged transport instead
//! of this one.

use crate::backend::CudaBackend;
use crate::error::{CudaError, DriverContext, Result};
use crate::kv::CudaKv;
use canopy_comm::{
    Collective, CommError, Group, HostPart, ReduceOp, ThreadComm, ThreadWorld, Traffic,
};
use canopy_engine::{EngineError, Result as EResult, Transport};
use canopy_kernels::{Kernel, REDUCE_MAX, REDUCE_SUM};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg};
use std::collections::VecDeque;
use std::fmt::Display;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// A world of ranks that are threads of this process sharing one GPU's context, each driving
/// its own [`CudaBackend`], with a device transport between them.
pub struct DeviceWorld;

impl DeviceWorld {
    /// Runs `f` on `size` ranks, each on its own thread with its own [`DeviceComm`], and
    /// returns each rank's result in rank order (as [`ThreadWorld::run`], on which it runs). A
    /// rank whose `f` fails or panics aborts the world, so that its peers' pending collectives
    /// and receives fail at once instead of waiting out `timeout`.
    pub fn run<T, E, F>(size: usize, timeout: Duration, f: F) -> Vec<std::result::Result<T, E>>
    where
        T: Send,
        E: Send + Display,
        F: Fn(DeviceComm) -> std::result::Result<T, E> + Sync,
    {
        let shared = Arc::new(Shared::new(size, timeout));
        ThreadWorld::run(size, timeout, |inner| {
            let rank = inner.rank();
            let _on_panic = AbortOnPanic {
                shared: &shared,
                rank,
            };
            let comm = DeviceComm {
                inner,
                shared: shared.clone(),
                bytes: AtomicU64::new(0),
                calls: AtomicU64::new(0),
            };
            let result = f(comm);
            if let Err(e) = &result {
                shared.abort(rank, e.to_string());
            }
            result
        })
    }
}

/// Aborts the world's mailboxes if its rank's thread unwinds, so that peers waiting on a
/// message from it fail at once.
struct AbortOnPanic<'a> {
    shared: &'a Shared,
    rank: usize,
}

impl Drop for AbortOnPanic<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.shared
                .abort(self.rank, "the rank's thread panicked".into());
        }
    }
}

/// A device buffer one rank published for a collective, and how many values it holds (an
/// allocation is at least one value long).
struct Published {
    data: CudaSlice<f32>,
    len: usize,
}

/// What travels through a mailbox. Each message is a fresh device buffer, allocated (and
/// freed) on its sender's stream, complete before it was queued.
enum Message {
    Buf {
        data: CudaSlice<f32>,
        len: usize,
    },
    Kv {
        tokens: usize,
        /// Bytes of K (or V) of one token: the sender's shape and dtype.
        token_bytes: usize,
        k: CudaSlice<u8>,
        v: CudaSlice<u8>,
    },
}

impl Message {
    fn describe(&self) -> String {
        match self {
            Message::Buf { len, .. } => format!("a buffer of {len} values"),
            Message::Kv {
                tokens,
                token_bytes,
                ..
            } => format!("{tokens} tokens of KV of {token_bytes} bytes each"),
        }
    }
}

/// The mailboxes, and why the world was aborted.
struct Mail {
    /// `boxes[from * size + to]`: messages from `from` to `to`, oldest first.
    boxes: Vec<VecDeque<Message>>,
    /// The first rank that failed, and why.
    abort: Option<(usize, String)>,
}

/// State shared by every rank of a [`DeviceWorld`].
struct Shared {
    timeout: Duration,
    /// Each rank's contribution to the all-gather in flight.
    published: Vec<Mutex<Option<Arc<Published>>>>,
    mail: Mutex<Mail>,
    /// Signalled on every message queued and on an abort.
    delivered: Condvar,
}

/// Locks `m`, taking the data of a lock whose holder panicked (the world is failing then
/// anyway, and the state stays consistent: every critical section is a push, pop or swap).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Shared {
    fn new(size: usize, timeout: Duration) -> Shared {
        Shared {
            timeout,
            published: (0..size).map(|_| Mutex::new(None)).collect(),
            mail: Mutex::new(Mail {
                boxes: (0..size * size).map(|_| VecDeque::new()).collect(),
                abort: None,
            }),
            delivered: Condvar::new(),
        }
    }

    fn abort(&self, by: usize, reason: String) {
        lock(&self.mail).abort.get_or_insert((by, reason));
        self.delivered.notify_all();
    }
}

/// One rank's handle on a [`DeviceWorld`]: the host collectives of its [`ThreadComm`], and a
/// [`Transport`] that moves [`CudaBackend`] buffers on the device.
pub struct DeviceComm {
    inner: ThreadComm,
    shared: Arc<Shared>,
    /// Device traffic, by the same ring-algorithm formulas as the host transports'.
    bytes: AtomicU64,
    calls: AtomicU64,
}

/// An error of the transport's own (not the driver's), as the CUDA backend reports errors.
fn transport_error(message: String) -> EngineError {
    CudaError::Unsupported(message).into()
}

/// Waits for `stream` whatever `enqueued` says, then reports the first failure: buffers that
/// the enqueued work reads must not be dropped (freed on their owners' streams) before it ran.
fn settle(stream: &CudaStream, enqueued: Result<()>) -> Result<()> {
    let synced = stream.synchronize().ctx("cuStreamSynchronize");
    enqueued?;
    synced
}

impl DeviceComm {
    fn count(&self, bytes: u64) {
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
        self.calls.fetch_add(1, Ordering::Relaxed);
    }

    fn check_peer(&self, peer: usize) -> EResult<()> {
        if peer >= self.size() {
            return Err(CommError::BadPeer {
                rank: self.rank(),
                peer,
                size: self.size(),
            }
            .into());
        }
        Ok(())
    }

    /// Refuses a range past the end of a buffer.
    fn check_range(&self, op: &str, len: usize, range: &Range<usize>) -> EResult<()> {
        if range.start > range.end || range.end > len {
            return Err(transport_error(format!(
                "rank {}: {op} of elements {range:?} of a buffer of {len}",
                self.rank()
            )));
        }
        Ok(())
    }

    fn aborted(&self, op: &'static str, by: usize, reason: &str) -> EngineError {
        CommError::Aborted {
            rank: self.rank(),
            op,
            by,
            reason: reason.to_string(),
        }
        .into()
    }

    fn mismatch(&self, op: &'static str, detail: String) -> EngineError {
        CommError::SizeMismatch {
            rank: self.rank(),
            op,
            detail,
        }
        .into()
    }

    /// Values `part` of every rank's `n` values of `src` into `dst`, `part.len()` a rank, in
    /// rank order (the all-gather of the module notes, of a part of each rank's values).
    fn gather<S: DevicePtr<f32>>(
        &self,
        b: &CudaBackend,
        src: &S,
        n: usize,
        part: Range<usize>,
        dst: &mut CudaSlice<f32>,
        op: &'static str,
    ) -> EResult<()> {
        let (me, p) = (self.rank(), self.size());
        let stream = b.stream();
        let mut mine = b.alloc::<f32>(n)?;
        let copied = if n > 0 {
            stream
                .memcpy_dtod(src, &mut mine.slice_mut(0..n))
                .ctx("cuMemcpyDtoDAsync (publishing)")
        } else {
            Ok(())
        };
        settle(stream, copied)?;
        *lock(&self.shared.published[me]) = Some(Arc::new(Published { data: mine, len: n }));
        self.inner.barrier()?;
        let mut held = Vec::with_capacity(p);
        let mut copy_all = || -> EResult<()> {
            for r in 0..p {
                let theirs = lock(&self.shared.published[r]).clone().ok_or_else(|| {
                    transport_error(format!(
                        "rank {me}: {op}: rank {r} published nothing past the barrier (the world's ranks are running different steps)"
                    ))
                })?;
                if theirs.len != n {
                    return Err(self.mismatch(
                        op,
                        format!("rank {r} sent {} values, expected {n}", theirs.len),
                    ));
                }
                let m = part.len();
                if m > 0 {
                    stream
                        .memcpy_dtod(
                            &theirs.data.slice(part.clone()),
                            &mut dst.slice_mut(r * m..(r + 1) * m),
                        )
                        .ctx("cuMemcpyDtoDAsync (gathering)")?;
                }
                held.push(theirs);
            }
            Ok(())
        };
        let copied = copy_all();
        // Peers' buffers are dropped only once this stream has read them.
        let synced = stream.synchronize().ctx("cuStreamSynchronize");
        drop(held);
        copied?;
        synced?;
        self.inner.barrier()?;
        lock(&self.shared.published[me]).take();
        Ok(())
    }

    /// `buf[into]` = the rank-order fold (`reduce_slots`, `combine.cu`) of every rank's values
    /// at the same places, `into` a part of `range`, the values every rank publishes.
    fn fold(
        &self,
        b: &CudaBackend,
        buf: &mut CudaSlice<f32>,
        range: Range<usize>,
        into: Range<usize>,
        op: ReduceOp,
        name: &'static str,
    ) -> EResult<()> {
        let (p, n) = (self.size(), into.len());
        let part = into.start - range.start..into.end - range.start;
        let mut slots = b.alloc::<f32>(p * n)?;
        self.gather(
            b,
            &buf.slice(range.clone()),
            range.len(),
            part,
            &mut slots,
            name,
        )?;
        if n == 0 {
            return Ok(());
        }
        let f = b.function(Kernel::Combine("reduce_slots"))?;
        let (count, len) = (p as u32, n as u64);
        let code = match op {
            ReduceOp::Sum => REDUCE_SUM,
            ReduceOp::Max => REDUCE_MAX,
        };
        let mut out = buf.slice_mut(into);
        let mut launch = b.stream().launch_builder(&f);
        launch
            .arg(&slots)
            .arg(&count)
            .arg(&len)
            .arg(&code)
            .arg(&mut out);
        let cfg = LaunchConfig {
            grid_dim: (
                len.div_ceil(256).min(4 * b.gpu().multiprocessors as u64) as u32,
                1,
                1,
            ),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: reads `count` slots of `len` values (`slots` holds p × n) and writes `len`
        // values into `into`, inside `buf` (the caller checked the range).
        unsafe { launch.launch(cfg) }.ctx("launching reduce_slots")?;
        // `slots` is freed on this stream, after the kernel that reads it.
        Ok(())
    }

    /// Queues `msg` for `peer`; never blocks.
    fn post(&self, op: &'static str, peer: usize, msg: Message) -> EResult<()> {
        let mut mail = lock(&self.shared.mail);
        if let Some((by, reason)) = &mail.abort {
            return Err(self.aborted(op, *by, reason));
        }
        mail.boxes[self.rank() * self.size() + peer].push_back(msg);
        drop(mail);
        self.shared.delivered.notify_all();
        Ok(())
    }

    /// The oldest message from `peer`, waiting for it up to the world's timeout.
    fn take(&self, op: &'static str, peer: usize) -> EResult<Message> {
        let sh = &self.shared;
        let deadline = Instant::now() + sh.timeout;
        let slot = peer * self.size() + self.rank();
        let mut mail = lock(&sh.mail);
        loop {
            if let Some(m) = mail.boxes[slot].pop_front() {
                return Ok(m);
            }
            if let Some((by, reason)) = &mail.abort {
                return Err(self.aborted(op, *by, reason));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(transport_error(format!(
                    "rank {}: {op} from rank {peer} timed out after {:.1} s with nothing sent; rank {peer} may have died, hung, or be running a different step (raise --timeout if the work is just slow)",
                    self.rank(),
                    sh.timeout.as_secs_f64()
                )));
            }
            mail = sh
                .delivered
                .wait_timeout(mail, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

impl Group for DeviceComm {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn size(&self) -> usize {
        self.inner.size()
    }
}

/// Host collectives, by the inner [`ThreadComm`]; traffic adds the device transport's.
impl HostPart for DeviceComm {
    type Host = ThreadComm;
    fn host(&self) -> &ThreadComm {
        &self.inner
    }

    fn own_traffic(&self) -> Traffic {
        Traffic {
            bytes: self.bytes.load(Ordering::Relaxed),
            calls: self.calls.load(Ordering::Relaxed),
        }
    }
}

impl Transport<CudaBackend> for DeviceComm {
    fn all_reduce_buf(
        &self,
        b: &CudaBackend,
        buf: &mut CudaSlice<f32>,
        range: Range<usize>,
        op: ReduceOp,
    ) -> EResult<()> {
        const OP: &str = "all_reduce_buf";
        self.check_range(OP, buf.len(), &range)?;
        let (p, n) = (self.size() as u64, range.len());
        self.fold(b, buf, range.clone(), range, op, OP)?;
        self.count(2 * (p - 1) * (n * 4) as u64 / p);
        Ok(())
    }

    /// Each rank gathers its own block of every rank's range and folds them: of the
    /// all-reduce's copies and folds, a `size()`-th.
    fn reduce_scatter_buf(
        &self,
        b: &CudaBackend,
        buf: &mut CudaSlice<f32>,
        range: Range<usize>,
        op: ReduceOp,
    ) -> EResult<()> {
        const OP: &str = "reduce_scatter_buf";
        self.check_range(OP, buf.len(), &range)?;
        let (p, n) = (self.size(), range.len());
        if !n.is_multiple_of(p) {
            let detail = format!("{n} values do not split into {p} equal blocks");
            return Err(self.mismatch(OP, detail));
        }
        let block = self.rank() * n / p..(self.rank() + 1) * n / p;
        let mine = range.start + block.start..range.start + block.end;
        self.fold(b, buf, range, mine, op, OP)?;
        self.count((p as u64 - 1) * (n * 4) as u64 / p as u64);
        Ok(())
    }

    fn all_gather_buf(
        &self,
        b: &CudaBackend,
        src: &CudaSlice<f32>,
        len: usize,
        dst: &mut CudaSlice<f32>,
    ) -> EResult<()> {
        const OP: &str = "all_gather_buf";
        let p = self.size();
        self.check_range(OP, src.len(), &(0..len))?;
        self.check_range(OP, dst.len(), &(0..len * p))?;
        self.gather(b, &src.slice(0..len), len, 0..len, dst, OP)?;
        self.count((len * p * 4) as u64 * (p as u64 - 1) / p as u64);
        Ok(())
    }

    fn send_buf(
        &self,
        b: &CudaBackend,
        buf: &CudaSlice<f32>,
        range: Range<usize>,
        peer: usize,
    ) -> EResult<()> {
        const OP: &str = "send_buf";
        self.check_peer(peer)?;
        self.check_range(OP, buf.len(), &range)?;
        let n = range.len();
        let stream = b.stream();
        let mut data = b.alloc::<f32>(n)?;
        let copied = if n > 0 {
            stream
                .memcpy_dtod(&buf.slice(range), &mut data.slice_mut(0..n))
                .ctx("cuMemcpyDtoDAsync (send_buf)")
        } else {
            Ok(())
        };
        settle(stream, copied)?;
        self.post(OP, peer, Message::Buf { data, len: n })?;
        self.count((n * 4) as u64);
        Ok(())
    }

    fn recv_buf(
        &self,
        b: &CudaBackend,
        buf: &mut CudaSlice<f32>,
        range: Range<usize>,
        peer: usize,
    ) -> EResult<()> {
        const OP: &str = "recv_buf";
        self.check_peer(peer)?;
        self.check_range(OP, buf.len(), &range)?;
        let n = range.len();
        let msg = self.take(OP, peer)?;
        let Message::Buf { data, len } = &msg else {
            return Err(self.mismatch(
                OP,
                format!("rank {peer} sent {}, expected {n} values", msg.describe()),
            ));
        };
        if *len != n {
            return Err(self.mismatch(OP, format!("rank {peer} sent {len} values, expected {n}")));
        }
        let stream = b.stream();
        let copied = if n > 0 {
            stream
                .memcpy_dtod(&data.slice(0..n), &mut buf.slice_mut(range))
                .ctx("cuMemcpyDtoDAsync (recv_buf)")
        } else {
            Ok(())
        };
        // The message is freed on its sender's stream: only once this one has read it.
        settle(stream, copied)?;
        Ok(())
    }

    fn send_kv(&self, b: &CudaBackend, kv: &CudaKv, tokens: usize, peer: usize) -> EResult<()> {
        const OP: &str = "send_kv";
        self.check_peer(peer)?;
        let gathered = b.gather_device(kv, tokens);
        // The message must be complete before the receiver's stream reads it.
        let synced = b.stream().synchronize().ctx("cuStreamSynchronize");
        let (k, v) = gathered?;
        synced?;
        let token_bytes = kv.bytes_of(1);
        self.post(
            OP,
            peer,
            Message::Kv {
                tokens,
                token_bytes,
                k,
                v,
            },
        )?;
        self.count(2 * (tokens * token_bytes) as u64);
        Ok(())
    }

    fn recv_kv(&self, b: &CudaBackend, kv: &mut CudaKv, tokens: usize, peer: usize) -> EResult<()> {
        const OP: &str = "recv_kv";
        self.check_peer(peer)?;
        let msg = self.take(OP, peer)?;
        let want = kv.bytes_of(1);
        match &msg {
            Message::Kv {
                tokens: t,
                token_bytes,
                k,
                v,
            } if *t == tokens && *token_bytes == want => {
                let scattered = b.scatter_device(kv, 0, tokens, k, v);
                // The message is freed on its sender's stream: only once this one has read it.
                settle(b.stream(), scattered)?;
                Ok(())
            }
            other => Err(self.mismatch(
                OP,
                format!(
                    "rank {peer} sent {}, expected {tokens} tokens of KV of {want} bytes each",
                    other.describe()
                ),
            )),
        }
    }
}
