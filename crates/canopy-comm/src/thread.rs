//! Ranks as threads of one process.

use crate::{Collective, CommError, Element, Group, ReduceOp, Result, Traffic};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::{Duration, Instant};

/// Why the world was aborted, and by whom.
#[derive(Debug, Clone)]
struct Abort {
    by: usize,
    reason: String,
}

#[derive(Debug, Default)]
struct BarrierState {
    arrived: usize,
    generation: u64,
    abort: Option<Abort>,
}

/// One direction of a point-to-point link: the receiving end, shared behind a lock.
type Inbox = Mutex<Receiver<Vec<u8>>>;

/// State shared by every rank of a [`ThreadWorld`].
struct Shared {
    size: usize,
    timeout: Duration,
    barrier: Mutex<BarrierState>,
    wake: Condvar,
    /// One staging slot per rank for all-reduce / all-gather: its rank writes it before a
    /// collective's first barrier, and every rank reads it, at once, between the two.
    slots: Vec<RwLock<Vec<u8>>>,
    /// Each rank's share of an all-reduce, folded over every rank's slot.
    folded: Vec<RwLock<Vec<u8>>>,
    /// `links[src][dst]`: the sender for messages from `src` to `dst`, and its receiver.
    senders: Vec<Vec<Sender<Vec<u8>>>>,
    receivers: Vec<Vec<Inbox>>,
}

/// A world of ranks that are threads of this process.
pub struct ThreadWorld;

impl ThreadWorld {
    /// Runs `f` on `size` ranks, each on its own thread with its own [`ThreadComm`], and
    /// returns each rank's result in rank order. A rank whose `f` fails aborts the world so
    /// that its peers' pending collectives fail instead of waiting out the timeout.
    pub fn run<T, E, F>(size: usize, timeout: Duration, f: F) -> Vec<std::result::Result<T, E>>
    where
        T: Send,
        E: Send + std::fmt::Display,
        F: Fn(ThreadComm) -> std::result::Result<T, E> + Sync,
    {
        let shared = Arc::new(Shared::new(size, timeout));
        std::thread::scope(|scope| {
            let handles: Vec<_> = (0..size)
                .map(|rank| {
                    let comm = ThreadComm {
                        rank,
                        shared: shared.clone(),
                        bytes: AtomicU64::new(0),
                        calls: AtomicU64::new(0),
                    };
                    let f = &f;
                    let shared = shared.clone();
                    scope.spawn(move || {
                        let result = f(comm);
                        if let Err(e) = &result {
                            shared.abort(rank, e.to_string());
                        }
                        result
                    })
                })
                .collect();
            handles
                .into_iter()
                .enumerate()
                .map(|(rank, h)| match h.join() {
                    Ok(r) => r,
                    Err(panic) => {
                        shared.abort(rank, "the rank's thread panicked".into());
                        std::panic::resume_unwind(panic)
                    }
                })
                .collect()
        })
    }
}

impl Shared {
    fn new(size: usize, timeout: Duration) -> Self {
        // senders[src][dst] pairs with receivers[dst][src].
        let mut senders: Vec<Vec<Sender<Vec<u8>>>> =
            (0..size).map(|_| Vec::with_capacity(size)).collect();
        let mut by_dst: Vec<Vec<Option<Inbox>>> = (0..size)
            .map(|_| (0..size).map(|_| None).collect())
            .collect();
        for (src, row) in senders.iter_mut().enumerate() {
            for dst_row in by_dst.iter_mut() {
                let (tx, rx) = channel();
                row.push(tx);
                dst_row[src] = Some(Mutex::new(rx));
            }
        }
        let receivers = by_dst
            .into_iter()
            .map(|row| row.into_iter().flatten().collect())
            .collect();
        Shared {
            size,
            timeout,
            barrier: Mutex::new(BarrierState::default()),
            wake: Condvar::new(),
            slots: (0..size).map(|_| RwLock::new(Vec::new())).collect(),
            folded: (0..size).map(|_| RwLock::new(Vec::new())).collect(),
            senders,
            receivers,
        }
    }

    fn abort(&self, by: usize, reason: String) {
        let mut st = self.barrier.lock().unwrap_or_else(|p| p.into_inner());
        st.abort.get_or_insert(Abort { by, reason });
        self.wake.notify_all();
    }

    fn aborted(&self) -> Option<Abort> {
        self.barrier
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .abort
            .clone()
    }
}

/// One rank's handle on a [`ThreadWorld`].
pub struct ThreadComm {
    rank: usize,
    shared: Arc<Shared>,
    bytes: AtomicU64,
    calls: AtomicU64,
}

impl ThreadComm {
    fn aborted_err(&self, op: &'static str, a: Abort) -> CommError {
        CommError::Aborted {
            rank: self.rank,
            op,
            by: a.by,
            reason: a.reason,
        }
    }

    fn count(&self, bytes: u64) {
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
        self.calls.fetch_add(1, Ordering::Relaxed);
    }

    fn wait_all(&self, op: &'static str) -> Result<()> {
        let sh = &self.shared;
        let deadline = Instant::now() + sh.timeout;
        let mut st = sh.barrier.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(a) = st.abort.clone() {
            return Err(self.aborted_err(op, a));
        }
        let generation = st.generation;
        st.arrived += 1;
        if st.arrived == sh.size {
            st.arrived = 0;
            st.generation += 1;
            sh.wake.notify_all();
            return Ok(());
        }
        loop {
            let now = Instant::now();
            if now >= deadline {
                return Err(CommError::Timeout {
                    rank: self.rank,
                    op,
                    secs: sh.timeout.as_secs_f64(),
                });
            }
            st = sh
                .wake
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
            if st.generation != generation {
                return Ok(());
            }
            if let Some(a) = st.abort.clone() {
                return Err(self.aborted_err(op, a));
            }
        }
    }

    fn check_peer(&self, peer: usize) -> Result<()> {
        if peer >= self.shared.size {
            return Err(CommError::BadPeer {
                rank: self.rank,
                peer,
                size: self.shared.size,
            });
        }
        Ok(())
    }

    fn stage<T: Element>(&self, data: &[T]) {
        let mut slot = self.shared.slots[self.rank]
            .write()
            .unwrap_or_else(|p| p.into_inner());
        slot.clear();
        slot.extend_from_slice(bytemuck::cast_slice(data));
    }

    /// Stages `buf` for every rank, waits for all, and folds elements `share` of every rank's
    /// copy into `buf`, in rank order. A peer may still read this rank's slot when it returns:
    /// the caller waits for all again before the slots can change.
    fn fold_staged<T: Element>(
        &self,
        buf: &mut [T],
        share: std::ops::Range<usize>,
        op: ReduceOp,
        name: &'static str,
    ) -> Result<()> {
        self.stage(buf);
        self.wait_all(name)?;
        let slots: Vec<_> = (self.shared.slots.iter())
            .map(|s| s.read().unwrap_or_else(|p| p.into_inner()))
            .collect();
        let want = size_of_val(buf);
        if let Some(r) = slots.iter().position(|s| s.len() != want) {
            let got = slots[r].len();
            drop(slots);
            self.shared
                .abort(self.rank, format!("{name} size mismatch"));
            return crate::check_bytes(self.rank, name, format_args!("rank {r}"), got, want);
        }
        let bytes = share.start * size_of::<T>()..share.end * size_of::<T>();
        crate::fold_rank_order(&mut buf[share], slots.iter().map(|s| &s[bytes.clone()]), op);
        Ok(())
    }
}

impl Group for ThreadComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.shared.size
    }
}

impl Collective for ThreadComm {
    /// A reduce-scatter, then an all-gather: each rank folds its share of the elements over
    /// every rank's copy, in rank order, and then copies the other shares as their ranks
    /// folded them. Every element is folded once, by one rank, in the same order as the MPI
    /// transport folds it, so every rank ends with the same bits, and the ranks fold
    /// `len` elements `P` times together rather than each folding all of them.
    fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let p = self.shared.size;
        let len = buf.len();
        let share = |r: usize| len * r / p..len * (r + 1) / p;
        let want = size_of_val(buf);
        let mine = share(self.rank);
        self.fold_staged(buf, mine.clone(), op, "all_reduce")?;
        {
            let mut folded = self.shared.folded[self.rank]
                .write()
                .unwrap_or_else(|p| p.into_inner());
            folded.clear();
            folded.extend_from_slice(bytemuck::cast_slice(&buf[mine]));
        }
        // Every share is folded. A rank writes its share again only after the next
        // collective's first barrier, which this rank reaches once it has copied them all.
        self.wait_all("all_reduce")?;
        for r in (0..p).filter(|&r| r != self.rank) {
            let folded = self.shared.folded[r]
                .read()
                .unwrap_or_else(|p| p.into_inner());
            bytemuck::cast_slice_mut::<T, u8>(&mut buf[share(r)]).copy_from_slice(&folded);
        }
        self.count(2 * (p as u64 - 1) * want as u64 / p as u64);
        Ok(())
    }

    /// The first half of [`ThreadComm::all_reduce`], on equal blocks: each rank folds its own.
    fn reduce_scatter<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let p = self.shared.size;
        crate::check_blocks(self.rank, buf.len(), p)?;
        let block = buf.len() / p;
        let mine = self.rank * block..(self.rank + 1) * block;
        self.fold_staged(buf, mine, op, "reduce_scatter")?;
        // No rank stages its next collective's data while a peer may still read this one's.
        self.wait_all("reduce_scatter")?;
        self.count((p as u64 - 1) * size_of_val(buf) as u64 / p as u64);
        Ok(())
    }

    fn all_gather<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        let p = self.shared.size;
        crate::check_gather_len(self.rank, send.len(), recv.len(), p)?;
        self.stage(send);
        self.wait_all("all_gather")?;
        for (r, chunk) in recv.chunks_mut(send.len().max(1)).enumerate().take(p) {
            let slot = self.shared.slots[r]
                .read()
                .unwrap_or_else(|p| p.into_inner());
            crate::check_bytes(
                self.rank,
                "all_gather",
                format_args!("rank {r}"),
                slot.len(),
                std::mem::size_of_val(chunk),
            )?;
            bytemuck::cast_slice_mut::<T, u8>(chunk).copy_from_slice(&slot);
        }
        self.wait_all("all_gather")?;
        self.count(std::mem::size_of_val(recv) as u64 * (p as u64 - 1) / p as u64);
        Ok(())
    }

    fn send<T: Element>(&self, buf: &[T], peer: usize) -> Result<()> {
        self.check_peer(peer)?;
        if let Some(a) = self.shared.aborted() {
            return Err(self.aborted_err("send", a));
        }
        // The receiver lives as long as the world, so a send cannot fail while ranks run.
        let _ = self.shared.senders[self.rank][peer].send(bytemuck::cast_slice(buf).to_vec());
        self.count(std::mem::size_of_val(buf) as u64);
        Ok(())
    }

    fn recv<T: Element>(&self, buf: &mut [T], peer: usize) -> Result<()> {
        self.check_peer(peer)?;
        let rx = self.shared.receivers[self.rank][peer]
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let deadline = Instant::now() + self.shared.timeout;
        // Poll in short slices so an abort elsewhere is noticed quickly.
        let msg = loop {
            if let Some(a) = self.shared.aborted() {
                return Err(self.aborted_err("recv", a));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(CommError::Timeout {
                    rank: self.rank,
                    op: "recv",
                    secs: self.shared.timeout.as_secs_f64(),
                });
            }
            match rx.recv_timeout((deadline - now).min(Duration::from_millis(20))) {
                Ok(m) => break m,
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => {
                    unreachable!("senders live as long as the world")
                }
            }
        };
        crate::check_bytes(
            self.rank,
            "recv",
            format_args!("peer {peer}"),
            msg.len(),
            std::mem::size_of_val(buf),
        )?;
        bytemuck::cast_slice_mut::<T, u8>(buf).copy_from_slice(&msg);
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        self.wait_all("barrier")
    }

    fn traffic(&self) -> Traffic {
        Traffic {
            bytes: self.bytes.load(Ordering::Relaxed),
            calls: self.calls.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Duration = Duration::from_secs(10);

    #[test]
    fn all_reduce_sums_and_maxes_in_rank_order() {
        let out = ThreadWorld::run(4, T, |c| {
            let mut s = vec![c.rank() as f32 + 1.0; 3];
            c.all_reduce(&mut s, ReduceOp::Sum)?;
            let mut m = vec![c.rank() as f32, -(c.rank() as f32)];
            c.all_reduce(&mut m, ReduceOp::Max)?;
            Ok::<_, CommError>((s, m, c.traffic()))
        });
        for r in out {
            let (s, m, t) = r.unwrap();
            assert_eq!(s, vec![10.0; 3]);
            assert_eq!(m, vec![3.0, 0.0]);
            assert_eq!(t.calls, 2);
            assert_eq!(t.bytes, 2 * 3 * 12 / 4 + 2 * 3 * 8 / 4);
        }
    }

    /// Each element folded in rank order, as one rank alone would fold it.
    fn folded_in_rank_order(copies: &[Vec<f32>], op: ReduceOp) -> Vec<f32> {
        let mut out = copies[0].clone();
        for copy in &copies[1..] {
            for (a, &b) in out.iter_mut().zip(copy) {
                *a = f32::reduce(*a, b, op);
            }
        }
        out
    }

    #[test]
    fn all_reduce_gives_every_rank_the_rank_order_fold_bit_for_bit() {
        // Lengths below, at and past the rank count, not multiples of it; values whose sums
        // round differently in another order.
        for (ranks, len) in [(1, 5), (3, 0), (3, 2), (5, 5), (7, 23), (8, 1000)] {
            let copy = |rank: usize| -> Vec<f32> {
                (0..len)
                    .map(|i| {
                        let x = ((rank * 7919 + i * 104_729) % 1000) as f32;
                        (x - 500.0) * 1.1e-3 * 10f32.powi((i % 7) as i32 - 3)
                    })
                    .collect()
            };
            let copies: Vec<Vec<f32>> = (0..ranks).map(copy).collect();
            for op in [ReduceOp::Sum, ReduceOp::Max] {
                let want = folded_in_rank_order(&copies, op);
                let out = ThreadWorld::run(ranks, T, |c| {
                    let mut buf = copy(c.rank());
                    c.all_reduce(&mut buf, op)?;
                    // Twice in a row: a share folded again must not be read half-written.
                    let mut again = copy(c.rank());
                    c.all_reduce(&mut again, op)?;
                    Ok::<_, CommError>((buf, again))
                });
                for res in out {
                    let (buf, again) = res.unwrap();
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&buf), bits(&want), "{ranks} ranks, {len} elements");
                    assert_eq!(bits(&again), bits(&want));
                }
            }
        }
    }

    /// Each rank's block is the rank-order fold of that block, the bits the all-reduce gives
    /// there; the other blocks are this rank's own; a length of no equal blocks is an error.
    #[test]
    fn reduce_scatter_folds_each_rank_its_own_block() {
        for (ranks, block) in [(1, 4), (2, 3), (3, 0), (5, 7)] {
            let len = ranks * block;
            let copy = |rank: usize| -> Vec<f32> {
                (0..len)
                    .map(|i| ((rank * 31 + i * 17) % 23) as f32 * 0.37 - 4.1)
                    .collect()
            };
            let copies: Vec<Vec<f32>> = (0..ranks).map(copy).collect();
            let want = folded_in_rank_order(&copies, ReduceOp::Sum);
            let out = ThreadWorld::run(ranks, T, |c| {
                let mut buf = copy(c.rank());
                c.reduce_scatter(&mut buf, ReduceOp::Sum)?;
                let mut all = copy(c.rank());
                c.all_reduce(&mut all, ReduceOp::Sum)?;
                Ok::<_, CommError>((buf, all, c.traffic()))
            });
            for (r, res) in out.into_iter().enumerate() {
                let (buf, all, traffic) = res.unwrap();
                let mine = r * block..(r + 1) * block;
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&buf[mine.clone()]), bits(&want[mine.clone()]));
                assert_eq!(bits(&buf[mine.clone()]), bits(&all[mine.clone()]));
                let own = copy(r);
                let others = (0..len).filter(|i| !mine.contains(i));
                assert!(others.clone().all(|i| buf[i] == own[i]), "{ranks} ranks");
                let (p, bytes) = (ranks as u64, 4 * len as u64);
                assert_eq!(traffic.bytes, (p - 1) * bytes / p + 2 * (p - 1) * bytes / p);
            }
        }
        let uneven = ThreadWorld::run(2, T, |c| c.reduce_scatter(&mut [1.0f32; 3], ReduceOp::Sum));
        assert!(uneven
            .iter()
            .all(|r| matches!(r, Err(CommError::SizeMismatch { .. }))));
    }

    #[test]
    fn all_gather_and_ring_send_recv() {
        let out = ThreadWorld::run(3, T, |c| {
            let mut all = vec![0.0f32; 6];
            c.all_gather(&[c.rank() as f32, 10.0 + c.rank() as f32], &mut all)?;
            let next = (c.rank() + 1) % 3;
            let prev = (c.rank() + 2) % 3;
            c.send(&[c.rank() as u8; 5], next)?;
            let mut got = [0u8; 5];
            c.recv(&mut got, prev)?;
            Ok::<_, CommError>((all, got))
        });
        for (r, res) in out.into_iter().enumerate() {
            let (all, got) = res.unwrap();
            assert_eq!(all, vec![0.0, 10.0, 1.0, 11.0, 2.0, 12.0]);
            assert_eq!(got, [((r + 2) % 3) as u8; 5]);
        }
    }

    #[test]
    fn a_failing_rank_aborts_its_peers_quickly() {
        let start = Instant::now();
        let out = ThreadWorld::run(3, Duration::from_secs(30), |c| {
            if c.rank() == 1 {
                return Err("rank 1 lost its GPU".to_string());
            }
            let mut x = [1.0f32];
            c.all_reduce(&mut x, ReduceOp::Sum)
                .map_err(|e| e.to_string())?;
            Ok(())
        });
        assert!(start.elapsed() < Duration::from_secs(5));
        for (r, res) in out.iter().enumerate() {
            let e = res.as_ref().unwrap_err();
            if r != 1 {
                assert!(
                    e.contains("because rank 1 failed") && e.contains("lost its GPU"),
                    "{e}"
                );
            }
        }
    }

    #[test]
    fn a_missing_peer_times_out() {
        let out = ThreadWorld::run(2, Duration::from_millis(200), |c| {
            if c.rank() == 0 {
                let mut x = [0u8; 1];
                c.recv(&mut x, 1)?; // rank 1 never sends
            }
            Ok::<_, CommError>(())
        });
        assert!(matches!(
            out[0],
            Err(CommError::Timeout {
                rank: 0,
                op: "recv",
                ..
            })
        ));
    }

    #[test]
    fn mismatched_sizes_are_errors_not_garbage() {
        let out = ThreadWorld::run(2, T, |c| {
            let mut x = vec![1.0f32; 1 + c.rank()];
            c.all_reduce(&mut x, ReduceOp::Sum)
        });
        assert!(out
            .iter()
            .any(|r| matches!(r, Err(CommError::SizeMismatch { .. }))));
    }
}
