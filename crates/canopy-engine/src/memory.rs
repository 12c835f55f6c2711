//! Host memory: what a run will allocate, and what this process may still allocate.
//!
//! A run that asks for more memory than the machine has does not fail cleanly: Rust aborts on
//! a failed allocation, and the kernel's OOM killer ends the process with no message at all.
//! So every run is priced before its first large allocation and refused, with both numbers in
//! GiB, when it cannot fit.

use crate::{EngineError, Result, Strategy};
use canopy_core::{AttnShape, DType};

/// Bytes in a GiB, for messages.
const GIB: f64 = (1u64 << 30) as f64;

/// The bytes this process can still allocate on the host: the least of the kernel's available
/// memory, the cgroup's remaining limit and the address-space limit (`ulimit -v`), each where
/// the machine reports it. `None` where none of them is known (not Linux).
pub fn host_available_bytes() -> Option<u64> {
    [
        meminfo_available(),
        cgroup_remaining(),
        address_space_remaining(),
    ]
    .into_iter()
    .flatten()
    .min()
}

/// Refuses `need` bytes of host memory for `what` when this process cannot allocate them.
pub fn ensure_host_fits(need: u64, what: &str) -> Result<()> {
    match host_available_bytes() {
        Some(available) if need > available => Err(EngineError::OutOfMemory {
            what: what.to_string(),
            need_gib: need as f64 / GIB,
            available_gib: available as f64 / GIB,
        }),
        _ => Ok(()),
    }
}

/// Host bytes of an attention problem over `tokens` KV tokens: K and V in `dtype`, the f32
/// values they are generated from (one of K or V at a time), and, with `oracle`, the f32 copy
/// of both that the f64 reference reads.
pub fn problem_bytes(shape: &AttnShape, dtype: DType, tokens: u64, oracle: bool) -> u64 {
    let elems = tokens.saturating_mul(shape.kv_token_elems() as u64);
    let stored = elems.saturating_mul(2 * dtype.size_bytes() as u64);
    let generated = elems.saturating_mul(4);
    let reference = if oracle { elems.saturating_mul(8) } else { 0 };
    stored.saturating_add(generated).saturating_add(reference)
}

/// Host bytes every CPU rank of one run allocates together, beyond the problem itself:
/// - each rank's shard of K and V, and the copy it is written from;
/// - the ring's two receive buffers of the largest shard per rank;
/// - the states: each rank's own and, where every rank holds every rank's partials (the
///   all-gather merge, the ring's per-shard plans), `ranks` of them per rank.
pub fn cpu_ranks_bytes(
    shape: &AttnShape,
    dtype: DType,
    tokens: u64,
    queries: u64,
    ranks: u64,
    strategy: Strategy,
) -> u64 {
    let kv = tokens.saturating_mul(2 * shape.kv_token_bytes(dtype) as u64);
    let shards = kv.saturating_mul(2);
    let ring = match strategy {
        Strategy::Ring => kv.saturating_mul(2),
        Strategy::Tree(_) => 0,
    };
    let state = queries
        .saturating_mul(shape.q_heads as u64)
        .saturating_mul((shape.head_dim + 1) as u64 * 4);
    // Every rank also holds all ranks' shard windows; count them with the states.
    let per_rank_states = match strategy {
        Strategy::Ring | Strategy::Tree(crate::MergeCollective::Allgather) => {
            ranks.saturating_mul(state)
        }
        Strategy::Tree(_) => state.saturating_mul(3),
    };
    let states = ranks.saturating_mul(per_rank_states.saturating_add(ranks.saturating_mul(64)));
    shards.saturating_add(ring).saturating_add(states)
}

fn meminfo_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The cgroup (v2) memory limit less what the cgroup already uses; `None` without a limit.
fn cgroup_remaining() -> Option<u64> {
    let read = |f: &str| std::fs::read_to_string(format!("/sys/fs/cgroup/{f}")).ok();
    let max: u64 = read("memory.max")?.trim().parse().ok()?; // "max" (no limit) fails here
    let current: u64 = read("memory.current")?.trim().parse().ok()?;
    Some(max.saturating_sub(current))
}

/// `ulimit -v` less the address space this process already maps; `None` when unlimited.
fn address_space_remaining() -> Option<u64> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit through a valid pointer.
    if unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut limit) } != 0
        || limit.rlim_cur == libc::RLIM_INFINITY
    {
        return None;
    }
    Some(limit.rlim_cur.saturating_sub(self_status_bytes("VmSize:")?))
}

/// The most memory this process has held resident (`VmHWM`) since it started or since
/// [`reset_peak_resident`]; `None` where the kernel does not say (not Linux).
pub fn peak_resident_bytes() -> Option<u64> {
    self_status_bytes("VmHWM:")
}

/// Restarts [`peak_resident_bytes`] from the memory resident now (Linux's `clear_refs`), so
/// that each of several runs in one process reports its own peak. Returns whether the kernel
/// took it; where it did not, the peak counts every run so far.
pub fn reset_peak_resident() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// A `kB` field of `/proc/self/status`, in bytes.
fn self_status_bytes(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    Some(line.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MergeCollective;

    fn shape() -> AttnShape {
        AttnShape {
            q_heads: 32,
            kv_heads: 8,
            head_dim: 128,
            scale: None,
        }
    }

    #[test]
    fn a_problem_counts_storage_generation_and_the_oracle() {
        let s = shape();
        let elems = 1000 * 8 * 128;
        assert_eq!(
            problem_bytes(&s, DType::Bf16, 1000, false),
            elems * 2 * 2 + elems * 4
        );
        assert_eq!(
            problem_bytes(&s, DType::Bf16, 1000, true),
            elems * 2 * 2 + elems * 4 + elems * 8
        );
    }

    #[test]
    fn rank_counts_that_cannot_fit_are_priced_beyond_any_machine() {
        let s = shape();
        let huge = cpu_ranks_bytes(
            &s,
            DType::Bf16,
            32768,
            1,
            100_000,
            Strategy::Tree(MergeCollective::Allgather),
        );
        assert!(huge > 1 << 40, "{huge}");
        let ring = cpu_ranks_bytes(&s, DType::Bf16, 32768, 1, 4, Strategy::Ring);
        let tree = cpu_ranks_bytes(
            &s,
            DType::Bf16,
            32768,
            1,
            4,
            Strategy::Tree(MergeCollective::Allreduce3),
        );
        assert!(ring > tree, "the ring's receive buffers count");
        assert_eq!(
            cpu_ranks_bytes(&s, DType::Bf16, u64::MAX, 1, 4, Strategy::Ring),
            u64::MAX
        );
    }

    #[test]
    fn the_peak_resident_memory_follows_what_was_touched() {
        let Some(before) = peak_resident_bytes() else {
            return; // not Linux
        };
        let touched = std::hint::black_box(vec![1u8; 128 << 20]);
        let after = peak_resident_bytes().unwrap();
        assert!(after >= before.max(128 << 20), "{before} then {after}");
        drop(touched);
        if reset_peak_resident() {
            assert!(peak_resident_bytes().unwrap() < after);
        }
    }

    #[test]
    fn a_need_beyond_the_machine_is_refused_with_both_numbers() {
        let err = ensure_host_fits(u64::MAX / 2, "the test").unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("GiB") && msg.contains("the test"), "{msg}");
        assert!(ensure_host_fits(1024, "a small run").is_ok());
    }
}
