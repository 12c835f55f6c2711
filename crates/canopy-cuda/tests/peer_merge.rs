//! The tree's all-gather merge as one kernel over the peers' memory (`NcclTransport` with a
//! GPU per rank, threads of this process), against the fold of the same states gathered on
//! the host (`combine_gathered`, the kernel after NCCL's all-gather: the same bits are
//! expected) and the f64 merge; eager merges of several sizes, one after another, and a merge
//! recorded as a CUDA graph and replayed on new states, so each CTA's epochs and the two
//! parities of the slots turn over many times. Also the scattered merge through NCCL's
//! reduce-scatter, against its all-reduce merge.
//!
//! It needs two GPUs that reach each other's memory and NCCL; elsewhere it prints why and
//! passes. The seed is printed; `CANOPY_TEST_SEED` repeats a run.

mod common;
mod merge_check;
mod peers;
use common::rng;
use merge_check::{
    assert_close, assert_ranks_agree, bits, error, random_states, reference_merge, rows_of,
    states_from_host,
};

use canopy_comm::{Collective, Group, HostPart, ThreadWorld};
use canopy_core::{AttnShape, AttnStates};
use canopy_cuda::{CudaBackend, NcclIds, NcclTransport};
use canopy_engine::{
    Backend, LayerOps, MergeCollective, MergeOps, NodeLayout, Result, StatesMerge, Strategy,
};
use rand::Rng;
use std::time::Duration;

const TEST: &str = "peer_merge";
const TIMEOUT: Duration = Duration::from_secs(120);
/// Replays of the recorded merge, each on new states.
const REPLAYS: usize = 5;

/// The fold after NCCL's all-gather, of every rank's `input` gathered through the host.
fn gathered_fold<C: Collective>(
    b: &CudaBackend,
    host: &C,
    shape: &AttnShape,
    rows: usize,
    input: &(Vec<f32>, Vec<f32>),
) -> Result<AttnStates> {
    let packed: Vec<f32> = input.0.iter().chain(&input.1).copied().collect();
    let mut all = vec![0f32; packed.len() * host.size()];
    host.all_gather(&packed, &mut all)?;
    let mut gathered = b.alloc_buf(all.len())?;
    b.buf_from_host(&all, &mut gathered, 0)?;
    let mut s = b.alloc_states(shape, rows)?;
    b.poison(&mut s)?;
    b.combine_gathered(&gathered, host.size(), &mut s)?;
    b.download(&s)
}

/// What one rank saw in one round: the peer merge's states and the gathered fold's.
type Round = (AttnStates, AttnStates);

/// One rank: eager merges of each `(shape, rows)`, then one recorded and replayed.
fn rank<C: Collective>(
    host: &C,
    ids: &NcclIds,
    sizes: &[(AttnShape, usize)],
    inputs: &[Vec<(Vec<f32>, Vec<f32>)>],
) -> Result<Vec<Round>> {
    let b = CudaBackend::new(host.rank())?;
    let p = host.size();
    let how = MergeCollective::Allgather;
    let layout = NodeLayout::single(p);
    let comm = NcclTransport::new(host, &b, ids, layout.clone(), Strategy::Tree(how), TIMEOUT)?;
    let mine = |round: usize| &inputs[round][comm.rank()];
    let mut rounds = Vec::new();
    let mut round = 0;
    let mut wrote = 0;
    for (shape, rows) in sizes {
        // An all-gather's traffic: this rank's packed state to each peer.
        wrote += (p - 1) * rows * shape.q_heads * (shape.head_dim + 1) * 4;
        let mut merge = StatesMerge::new(&b, rows * shape.q_heads, shape.head_dim, p)?;
        let mut s = b.alloc_states(shape, *rows)?;
        states_from_host(&b, mine(round), &mut s)?;
        merge.run(&b, &comm, &mut s, how, &layout)?;
        rounds.push((
            b.download(&s)?,
            gathered_fold(&b, host, shape, *rows, mine(round))?,
        ));
        round += 1;
    }
    assert_eq!(
        comm.peer_merge_active(),
        Some(true),
        "the peer merge set up"
    );
    assert_eq!(
        comm.own_traffic().bytes,
        wrote as u64,
        "the peer merges' traffic"
    );
    let (shape, rows) = sizes[0];
    let mut merge = StatesMerge::new(&b, rows * shape.q_heads, shape.head_dim, p)?;
    let mut s = b.alloc_states(&shape, rows)?;
    b.poison(&mut s)?;
    b.begin_capture()?;
    let recorded = merge.run(&b, &comm, &mut s, how, &layout);
    let graph = b.end_capture()?;
    recorded?;
    for _ in 0..REPLAYS {
        states_from_host(&b, mine(round), &mut s)?;
        b.replay(&graph)?;
        rounds.push((
            b.download(&s)?,
            gathered_fold(&b, host, &shape, rows, mine(round))?,
        ));
        round += 1;
    }
    Ok(rounds)
}

#[test]
fn the_peer_merge_matches_the_gathered_fold_eager_and_replayed() {
    let Some(gpus) = peers::gpus(TEST) else {
        return;
    };
    let mut rng = rng(TEST);
    // Llama's decode (32 heads of 128) at one row and at a batch whose cells outnumber the
    // grid's warps, and SmolLM2's (9 heads of 64) at a few rows.
    let sizes = [
        (AttnShape::new(32, 8, 128).unwrap(), 1),
        (AttnShape::new(32, 8, 128).unwrap(), 72),
        (AttnShape::new(9, 3, 64).unwrap(), 5),
    ];
    for p in 2..=gpus {
        let rounds = sizes.len() + REPLAYS;
        // The eager rounds take each size in turn; the replays, the first.
        let shape_of = |round: usize| sizes[if round < sizes.len() { round } else { 0 }];
        let inputs: Vec<Vec<_>> = (0..rounds)
            .map(|round| {
                let (shape, rows) = shape_of(round);
                let cells = rows * shape.q_heads;
                let empty: Vec<bool> = (0..cells).map(|_| rng.gen_bool(0.05)).collect();
                (0..p)
                    .map(|_| random_states(&mut rng, cells, shape.head_dim, &empty))
                    .collect()
            })
            .collect();
        let ids = NcclIds::new(1).expect("NCCL ids");
        let out: Vec<Vec<Round>> =
            ThreadWorld::run(p, TIMEOUT, |host| rank(&host, &ids, &sizes, &inputs))
                .into_iter()
                .map(|r| r.expect("the rank ran"))
                .collect();
        eprintln!("p = {p}:");
        for round in 0..rounds {
            let (shape, rows) = shape_of(round);
            let what = format!(
                "p={p} round {round} ({} cells of {})",
                rows * shape.q_heads,
                shape.head_dim
            );
            let peer: Vec<AttnStates> = out.iter().map(|r| r[round].0.clone()).collect();
            assert_ranks_agree(&what, &peer);
            for (r, rank_rounds) in out.iter().enumerate() {
                let (merged, folded) = &rank_rounds[round];
                assert_close(&format!("{what}, rank {r}: vs the fold"), merged, folded);
                assert!(
                    bits(merged) == bits(folded),
                    "{what}: rank {r}'s peer merge differs from the gathered fold"
                );
            }
            let oracle = reference_merge(&inputs[round], rows * shape.q_heads, shape.head_dim);
            let (eo, el) = (
                error(&peer[0].o, &oracle.o),
                error(&peer[0].lse, &oracle.lse),
            );
            eprintln!("  {what:<44} vs f64: o {eo:.1e}  lse {el:.1e}");
            assert!(eo < 1e-5 && el < 1e-5, "{what}: far from the f64 merge");
        }
    }
}

/// Each rank's block of the scattered merge (NCCL's reduce-scatter) against the all-reduce
/// merge of the same states, and the f64 merge; with half the traffic, about.
#[test]
fn a_scattered_merge_through_nccl_gives_each_rank_its_block() {
    const TEST: &str = "peer_merge: scattered";
    let Some(gpus) = peers::gpus(TEST) else {
        return;
    };
    let mut rng = rng(TEST);
    let shape = AttnShape::new(32, 8, 128).unwrap();
    for p in 2..=gpus {
        let (rows_a_rank, how) = (5, MergeCollective::Allreduce2);
        let (rows, d) = (rows_a_rank * p, shape.head_dim);
        let cells = rows * shape.q_heads;
        let empty: Vec<bool> = (0..cells).map(|_| rng.gen_bool(0.05)).collect();
        let inputs: Vec<_> = (0..p)
            .map(|_| random_states(&mut rng, cells, d, &empty))
            .collect();
        let ids = NcclIds::new(1).expect("NCCL ids");
        let out = ThreadWorld::run(p, TIMEOUT, |host| -> Result<_> {
            let b = CudaBackend::new(host.rank())?;
            let layout = NodeLayout::single(p);
            let comm = NcclTransport::new(
                &host,
                &b,
                &ids,
                layout.clone(),
                Strategy::Tree(how),
                TIMEOUT,
            )?;
            let mut merge = StatesMerge::new(&b, cells, d, p)?;
            let mut run = |scattered: bool| -> Result<(AttnStates, u64)> {
                let mut s = b.alloc_states(&shape, rows)?;
                b.poison(&mut s)?;
                states_from_host(&b, &inputs[host.rank()], &mut s)?;
                let before = comm.own_traffic().bytes;
                match scattered {
                    true => merge.run_scattered(&b, &comm, &mut s)?,
                    false => merge.run(&b, &comm, &mut s, how, &layout)?,
                }
                Ok((b.download(&s)?, comm.own_traffic().bytes - before))
            };
            Ok((run(false)?, run(true)?))
        });
        let oracle = reference_merge(&inputs, cells, d);
        for (r, res) in out.into_iter().enumerate() {
            let ((whole, whole_bytes), (scattered, bytes)) = res.expect("the rank ran");
            let (what, own) = (
                format!("p={p} rank {r}"),
                r * rows_a_rank..(r + 1) * rows_a_rank,
            );
            let mine = rows_of(&scattered, own.clone());
            assert_close(
                &format!("{what}: vs all-reduce"),
                &mine,
                &rows_of(&whole, own.clone()),
            );
            // The oracle's rows are cells.
            let want = rows_of(&oracle, own.start * shape.q_heads..own.end * shape.q_heads);
            let (eo, el) = (error(&mine.o, &want.o), error(&mine.lse, &want.lse));
            assert!(eo < 1e-5 && el < 1e-5, "{what}: far from the f64 merge");
            assert!(
                2 * bytes < whole_bytes + whole_bytes / 4,
                "{what}: {bytes} bytes against {whole_bytes}"
            );
        }
    }
}
