//! The in-device transport ([`DeviceWorld`]: ranks as threads sharing GPU 0, buffers moved
//! on the device) against the host-staged one ([`ThreadWorld`] through the engine's blanket
//! `Transport`), on the same CUDA backend and the same random inputs: every merge form and
//! the scattered merge, the ring's KV hand-off through contiguous and paged pools, and whole tree and ring steps. Both
//! sides fold in rank order with the same kernels, so they should agree bit for bit; the tests
//! hold them to 1e-6 relative (and print the largest difference), and every rank of a world to
//! the same bits after a step, tree or ring.
//!
//! Without a GPU (no driver, no device, no NVRTC) every test prints why and passes. The seed
//! is printed; `CANOPY_TEST_SEED` repeats a run.

mod common;
mod kv_io;
mod merge_check;
use common::rng;
use kv_io::{random_kv, read_kv};
use merge_check::{
    assert_close, assert_ranks_agree, bits, error, random_states, reference_merge, rows_of,
    states_from_host,
};

use canopy_comm::{Collective, Group, ThreadWorld};
use canopy_core::{random_tree, AttnShape, AttnStates, DType, Method, PlannerConfig, TypedVec};
use canopy_cuda::compile::{arch_for, cubin};
use canopy_cuda::{CudaBackend, DeviceComm, DeviceWorld};
use canopy_engine::{
    rank_main, Backend, MergeCollective, MergeOps, NodeLayout, Problem, Result, RunConfig,
    StatesMerge, Strategy, Transport,
};
use canopy_kernels::{MmaPipeline, Variant, DECODE_ROWS};
use rand::Rng;
use std::sync::Mutex;
use std::time::Duration;

const TIMEOUT: Duration = Duration::from_secs(120);
const RANKS: [usize; 2] = [2, 3];
const PAGE: u32 = 16;

/// A backend on GPU 0, or `None` (with a note) on a machine that cannot run one; the kernels
/// the tests use are compiled once, before any world starts (so that ranks load them from the
/// cache instead of all compiling them at once). A test holds the backend while it runs, so
/// the device's primary context lives from one world to the next instead of being created
/// again for each.
fn gpu(test: &str) -> Option<CudaBackend> {
    static WARM: Mutex<bool> = Mutex::new(false);
    let b = common::gpu(test)?;
    let mut warm = WARM.lock().unwrap_or_else(|p| p.into_inner());
    if !*warm {
        let arch = arch_for(b.gpu().compute_capability);
        let variants = [
            Variant::Combine,
            Variant::Merge { deep: false },
            Variant::Merge { deep: true },
            Variant::DecodeMma {
                dtype: DType::Bf16,
                head_dim: 128,
                pipeline: MmaPipeline::default(),
            },
        ]
        .into_iter()
        .chain(DECODE_ROWS.map(|rows| Variant::Decode {
            dtype: DType::Bf16,
            head_dim: 128,
            rows,
        }));
        for v in variants {
            cubin(&v, &arch).unwrap_or_else(|e| panic!("{test}: compiling {v:?}: {e}"));
        }
        *warm = true;
    }
    Some(b)
}

/// Ranks on two nodes: the first half (rounded up) and the rest.
fn two_nodes(p: usize) -> NodeLayout {
    let names: Vec<&str> = (0..p)
        .map(|r| if r < p.div_ceil(2) { "a" } else { "b" })
        .collect();
    NodeLayout::from_host_names(&names)
}

/// Every concrete merge of this rank's `(o, lse)` over `comm`, each from the same input
/// states, in [`MergeCollective::CONCRETE`] order; and the traffic they took.
fn merge_all<C: Transport<CudaBackend> + Collective>(
    comm: &C,
    shape: &AttnShape,
    rows: usize,
    input: &(Vec<f32>, Vec<f32>),
    layout: &NodeLayout,
) -> Result<(Vec<AttnStates>, u64, u64)> {
    let b = CudaBackend::new(0)?;
    let (cells, d) = (rows * shape.q_heads, shape.head_dim);
    let mut merge = StatesMerge::new(&b, cells, d, comm.size())?;
    let before = comm.traffic();
    let mut out = Vec::new();
    for how in MergeCollective::CONCRETE {
        let mut states = b.alloc_states(shape, rows)?;
        b.poison(&mut states)?;
        states_from_host(&b, input, &mut states)?;
        merge.run(&b, comm, &mut states, how, layout)?;
        out.push(b.download(&states)?);
    }
    let after = comm.traffic();
    Ok((out, after.bytes - before.bytes, after.calls - before.calls))
}

#[test]
fn every_merge_matches_the_host_staged_transport() {
    const TEST: &str = "every_merge_matches_the_host_staged_transport";
    let Some(_gpu) = gpu(TEST) else {
        return;
    };
    let mut rng = rng(TEST);
    let shape = AttnShape::new(8, 2, 128).unwrap();
    let rows = 7;
    let (cells, d) = (rows * shape.q_heads, shape.head_dim);
    for p in RANKS {
        let layout = two_nodes(p);
        // A few cells empty on every rank; the rest empty on some.
        let empty: Vec<bool> = (0..cells).map(|c| c % 11 == 3).collect();
        let inputs: Vec<_> = (0..p)
            .map(|_| random_states(&mut rng, cells, d, &empty))
            .collect();
        let device = DeviceWorld::run(p, TIMEOUT, |comm: DeviceComm| {
            merge_all(&comm, &shape, rows, &inputs[comm.rank()], &layout)
        });
        let host = ThreadWorld::run(p, TIMEOUT, |comm| {
            merge_all(&comm, &shape, rows, &inputs[comm.rank()], &layout)
        });
        let device: Vec<_> = device.into_iter().map(|r| r.unwrap()).collect();
        let host: Vec<_> = host.into_iter().map(|r| r.unwrap()).collect();
        let oracle = reference_merge(&inputs, cells, d);
        eprintln!("p = {p} ({} nodes):", layout.nodes());
        for (i, how) in MergeCollective::CONCRETE.into_iter().enumerate() {
            let on_device: Vec<AttnStates> = device.iter().map(|r| r.0[i].clone()).collect();
            let on_host: Vec<AttnStates> = host.iter().map(|r| r.0[i].clone()).collect();
            let what = format!("p={p} {}", how.name());
            assert_ranks_agree(&format!("{what} on the device"), &on_device);
            assert_ranks_agree(&format!("{what} through the host"), &on_host);
            assert_close(
                &format!("{what}: device vs host"),
                &on_device[0],
                &on_host[0],
            );
            let got = &on_device[0];
            let (eo, el) = (error(&got.o, &oracle.o), error(&got.lse, &oracle.lse));
            eprintln!(
                "  {:<44} o {eo:.1e}  lse {el:.1e}",
                format!("{what}: vs f64")
            );
            assert!(eo < 1e-5 && el < 1e-5, "{what}: far from the f64 merge");
            for (c, &e) in empty.iter().enumerate() {
                if e {
                    assert!(
                        got.lse[c] == f32::NEG_INFINITY
                            && got.o[c * d..(c + 1) * d].iter().all(|&x| x == 0.0),
                        "{what}: cell {c}, empty everywhere, is not empty"
                    );
                }
            }
        }
        for (r, (dev, hst)) in device.iter().zip(&host).enumerate() {
            assert_eq!(
                (dev.1, dev.2),
                (hst.1, hst.2),
                "p={p} rank {r}: device traffic (bytes, calls) differs from the host transport's"
            );
        }
    }
}

/// The all-reduce merge, then the scattered one, of this rank's `(o, lse)` over `comm`, each
/// from the same input states; and the traffic each took.
fn merge_whole_and_scattered<C: Transport<CudaBackend> + Collective>(
    comm: &C,
    shape: &AttnShape,
    rows: usize,
    input: &(Vec<f32>, Vec<f32>),
) -> Result<[(AttnStates, u64); 2]> {
    let b = CudaBackend::new(0)?;
    let (cells, d) = (rows * shape.q_heads, shape.head_dim);
    let mut merge = StatesMerge::new(&b, cells, d, comm.size())?;
    let layout = NodeLayout::single(comm.size());
    let mut run = |scattered: bool| -> Result<(AttnStates, u64)> {
        let mut states = b.alloc_states(shape, rows)?;
        b.poison(&mut states)?;
        states_from_host(&b, input, &mut states)?;
        let before = comm.traffic().bytes;
        match scattered {
            true => merge.run_scattered(&b, comm, &mut states)?,
            false => merge.run(&b, comm, &mut states, MergeCollective::Allreduce2, &layout)?,
        }
        Ok((b.download(&states)?, comm.traffic().bytes - before))
    };
    Ok([run(false)?, run(true)?])
}

/// The scattered merge leaves each rank its own block of rows with the bits of the all-reduce
/// merge, on the device and through the host, for less traffic.
#[test]
fn a_scattered_merge_gives_each_rank_its_block() {
    const TEST: &str = "a_scattered_merge_gives_each_rank_its_block";
    let Some(_gpu) = gpu(TEST) else {
        return;
    };
    let mut rng = rng(TEST);
    let shape = AttnShape::new(8, 2, 128).unwrap();
    for p in RANKS {
        let rows = 3 * p;
        let (cells, d) = (rows * shape.q_heads, shape.head_dim);
        let empty: Vec<bool> = (0..cells).map(|c| c % 11 == 3).collect();
        let inputs: Vec<_> = (0..p)
            .map(|_| random_states(&mut rng, cells, d, &empty))
            .collect();
        let device = DeviceWorld::run(p, TIMEOUT, |comm: DeviceComm| {
            merge_whole_and_scattered(&comm, &shape, rows, &inputs[comm.rank()])
        });
        let host = ThreadWorld::run(p, TIMEOUT, |comm| {
            merge_whole_and_scattered(&comm, &shape, rows, &inputs[comm.rank()])
        });
        for (r, (dev, hst)) in device.into_iter().zip(host).enumerate() {
            let ([(whole, whole_bytes), (scattered, bytes)], [_, (on_host, _)]) =
                (dev.unwrap(), hst.unwrap());
            let (what, own) = (format!("p={p} rank {r}"), r * 3..(r + 1) * 3);
            let mine = rows_of(&scattered, own.clone());
            assert!(
                bits(&mine) == bits(&rows_of(&whole, own.clone())),
                "{what}: the scattered merge's block differs from the all-reduce merge's"
            );
            assert_close(
                &format!("{what}: device vs host"),
                &mine,
                &rows_of(&on_host, own),
            );
            assert!(
                bytes < whole_bytes,
                "{what}: {bytes} bytes against {whole_bytes}"
            );
        }
    }
}

#[test]
fn kv_travels_through_page_tables() {
    const TEST: &str = "kv_travels_through_page_tables";
    let Some(_gpu) = gpu(TEST) else {
        return;
    };
    let mut rng = rng(TEST);
    let shape = AttnShape::new(8, 2, 128).unwrap();
    let dtype = DType::Bf16;
    let token_bytes = shape.kv_token_bytes(dtype);
    // 37 tokens cross pages of 16 and end inside one; sender and receiver pools differ in
    // size, so their shuffled page tables differ.
    let (sent, send_room, recv_room) = (37usize, 45usize, 50usize);
    for p in RANKS {
        let own: Vec<[TypedVec; 2]> = (0..p)
            .map(|_| random_kv(&mut rng, &shape, dtype, send_room))
            .collect();
        let before: Vec<[TypedVec; 2]> = (0..p)
            .map(|_| random_kv(&mut rng, &shape, dtype, recv_room))
            .collect();
        let out = DeviceWorld::run(p, TIMEOUT, |comm: DeviceComm| -> Result<_> {
            let me = comm.rank();
            let (next, prev) = ((me + 1) % p, (me + p - 1) % p);
            let flat = CudaBackend::new(0)?;
            let paged = CudaBackend::new(0)?.with_paging(PAGE)?;
            let mut checked = Vec::new();
            for (send_paged, recv_paged) in
                [(false, false), (false, true), (true, false), (true, true)]
            {
                let (sb, rb) = (
                    if send_paged { &paged } else { &flat },
                    if recv_paged { &paged } else { &flat },
                );
                let mut mine = sb.alloc_kv(&shape, dtype, send_room)?;
                sb.write_kv(&mut mine, 0, &own[me][0], &own[me][1])?;
                let mut got = rb.alloc_kv(&shape, dtype, recv_room)?;
                rb.write_kv(&mut got, 0, &before[me][0], &before[me][1])?;
                // Both directions of each pair send before they receive: sends never block.
                comm.send_kv(sb, &mine, sent, next)?;
                comm.send_kv(sb, &mine, 5, me)?;
                comm.recv_kv(rb, &mut got, sent, prev)?;
                let (k, v) = read_kv(rb, &comm, &got, recv_room, token_bytes)?;
                let split = sent * token_bytes;
                let want_k = [
                    &own[prev][0].as_bytes()[..split],
                    &before[me][0].as_bytes()[split..],
                ]
                .concat();
                let want_v = [
                    &own[prev][1].as_bytes()[..split],
                    &before[me][1].as_bytes()[split..],
                ]
                .concat();
                assert!(
                    k == want_k && v == want_v,
                    "p={p} rank {me}: paged {send_paged} -> {recv_paged}: KV differs"
                );
                // The message to itself, into the pool just checked.
                comm.recv_kv(rb, &mut got, 5, me)?;
                let (k, _) = read_kv(rb, &comm, &got, 5, token_bytes)?;
                assert!(
                    k == own[me][0].as_bytes()[..5 * token_bytes],
                    "p={p} rank {me}: self-send differs"
                );
                checked.push((send_paged, recv_paged));
            }
            Ok(checked)
        });
        for (r, res) in out.into_iter().enumerate() {
            let checked = res.unwrap_or_else(|e| panic!("p={p} rank {r}: {e}"));
            assert_eq!(checked.len(), 4);
        }
        eprintln!("  p={p}: {sent} tokens contiguous/paged -> contiguous/paged, and to self: equal bit for bit");
    }
}

#[test]
fn failures_are_prompt_and_name_their_ranks() {
    const TEST: &str = "failures_are_prompt_and_name_their_ranks";
    let Some(_gpu) = gpu(TEST) else {
        return;
    };
    // Nobody sends: the receiver times out, naming both ranks and the call.
    let out = DeviceWorld::run(
        2,
        Duration::from_millis(300),
        |comm: DeviceComm| -> Result<()> {
            let b = CudaBackend::new(0)?;
            if comm.rank() == 0 {
                let mut buf = b.alloc_buf(4)?;
                comm.recv_buf(&b, &mut buf, 0..4, 1)?;
            }
            Ok(())
        },
    );
    let e = out[0].as_ref().unwrap_err().to_string();
    assert!(e.contains("rank 0: recv_buf from rank 1 timed out"), "{e}");
    eprintln!("  timeout: {e}");

    // A rank fails: its peer's receive fails at once, saying who failed and why.
    let start = std::time::Instant::now();
    let out = DeviceWorld::run(
        2,
        Duration::from_secs(60),
        |comm: DeviceComm| -> Result<()> {
            let b = CudaBackend::new(0)?;
            if comm.rank() == 1 {
                return Err(canopy_engine::EngineError::Config(
                    "rank 1 lost its KV".into(),
                ));
            }
            let mut buf = b.alloc_buf(4)?;
            comm.recv_buf(&b, &mut buf, 0..4, 1)
        },
    );
    let e = out[0].as_ref().unwrap_err().to_string();
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "the abort took {:?}",
        start.elapsed()
    );
    assert!(
        e.contains("because rank 1 failed") && e.contains("lost its KV"),
        "{e}"
    );
    eprintln!("  abort: {e}");

    // Sizes that disagree are errors, not garbage.
    let out = DeviceWorld::run(
        2,
        Duration::from_secs(60),
        |comm: DeviceComm| -> Result<()> {
            let b = CudaBackend::new(0)?;
            let mut buf = b.alloc_buf(8)?;
            let peer = 1 - comm.rank();
            comm.send_buf(&b, &buf, 0..4 + comm.rank(), peer)?;
            comm.recv_buf(&b, &mut buf, 0..4 + comm.rank(), peer)
        },
    );
    assert!(
        out.iter()
            .all(|r| r.as_ref().is_err_and(|e| e.to_string().contains("sent"))),
        "{:?}",
        out.iter()
            .map(|r| r.as_ref().map_err(|e| e.to_string()))
            .collect::<Vec<_>>()
    );
    eprintln!("  mismatch: {}", out[0].as_ref().unwrap_err());
}

/// One decode step of `strategy` on every rank, over `comm` on a fresh backend (paged or
/// not): rank_main's tree or ring, outputs poisoned first.
fn step<C: Transport<CudaBackend> + Collective>(
    comm: &C,
    problem: &Problem,
    strategy: Strategy,
    paged: bool,
) -> Result<AttnStates> {
    let b = CudaBackend::new(0)?;
    let b = if paged { b.with_paging(PAGE)? } else { b };
    let cfg = RunConfig {
        ranks: comm.size(),
        strategy,
        method: Method::DeftFlatten,
        planner: PlannerConfig::default(),
        warmup: 0,
        iters: 1,
        cache: canopy_engine::Cache::Warm,
        timeout: TIMEOUT,
        poison: true,
        // Two virtual nodes where they divide the ranks (else one node).
        virtual_nodes: comm.size().is_multiple_of(2).then_some(2),
        stall_rank: None,
    };
    Ok(rank_main(problem, &cfg, &b, comm)?.output)
}

#[test]
fn tree_and_ring_steps_match_the_host_staged_transport() {
    const TEST: &str = "tree_and_ring_steps_match_the_host_staged_transport";
    let Some(_gpu) = gpu(TEST) else {
        return;
    };
    let mut rng = rng(TEST);
    let shape = AttnShape::new(8, 2, 128).unwrap();
    for p in RANKS {
        let seed = rng.gen();
        let problem = Problem::random(random_tree(seed, 12, 300), shape, DType::Bf16, seed);
        let oracle: Vec<f64> = problem.oracle();
        eprintln!(
            "p = {p}: {} tokens, {} queries",
            problem.tree.total_tokens(),
            problem.tree.num_queries()
        );
        for strategy in [
            Strategy::Tree(MergeCollective::Allreduce2),
            Strategy::Tree(MergeCollective::Hierarchical),
            Strategy::Ring,
        ] {
            for paged in [false, true] {
                let what = format!(
                    "p={p} {} {}",
                    strategy.name(),
                    if paged { "paged" } else { "contiguous" }
                );
                let device = DeviceWorld::run(p, TIMEOUT, |comm: DeviceComm| {
                    step(&comm, &problem, strategy, paged)
                });
                let host =
                    ThreadWorld::run(p, TIMEOUT, |comm| step(&comm, &problem, strategy, paged));
                let device: Vec<AttnStates> = device
                    .into_iter()
                    .map(|r| r.unwrap_or_else(|e| panic!("{what}: {e}")))
                    .collect();
                let host: Vec<AttnStates> = host
                    .into_iter()
                    .map(|r| r.unwrap_or_else(|e| panic!("{what}: {e}")))
                    .collect();
                assert_ranks_agree(&format!("{what} on the device"), &device);
                assert_ranks_agree(&format!("{what} through the host"), &host);
                assert_close(&format!("{what}: device vs host"), &device[0], &host[0]);
                for (r, dev) in device.iter().enumerate() {
                    let err = canopy_core::relative_error(&dev.o, &oracle);
                    assert!(
                        err < 1e-2,
                        "{what}: rank {r} is {err:e} from the f64 oracle"
                    );
                }
            }
        }
    }
}
