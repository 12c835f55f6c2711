//! The ring's hand-off on the copy engines over the peers' memory (`NcclTransport` with a GPU
//! per rank, threads of this process). Every rank's shard goes round the ring hop by hop in the
//! ring step's two receive buffers, and each rank checks every shard that arrives, bit for bit,
//! against the one its owner wrote, and that the buffer past it still holds what it held. Rounds of
//! growing shards make the landing slots grow, then a smaller round reuses them; shards differ
//! in size between ranks (one is empty), so pieces differ between a rank's send and its
//! receive; and the own shard is contiguous in some rounds and paged in others.
//!
//! It needs two GPUs that reach each other's memory and NCCL; elsewhere it prints why and
//! passes. The seed is printed; `CANOPY_TEST_SEED` repeats a run.

mod common;
mod kv_io;
mod peers;
use common::rng;
use kv_io::{random_kv, read_kv};

use canopy_comm::{Collective, HostPart, ThreadWorld};
use canopy_core::{AttnShape, DType, TypedVec};
use canopy_cuda::{CudaBackend, NcclIds, NcclTransport};
use canopy_engine::step::ring_buffers;
use canopy_engine::{Backend, NodeLayout, Result, Strategy, Transport};
use rand::Rng;
use std::time::Duration;

const TEST: &str = "peer_ring";
const TIMEOUT: Duration = Duration::from_secs(120);
const PAGE: u32 = 64;

/// One round: every rank's shard in tokens, and whether the own shards are paged.
struct Round {
    tokens: Vec<usize>,
    paged: bool,
}

/// One rank: each round's shards round the ring; every arrival checked. Returns the bytes
/// this rank handed off.
fn rank<C: Collective>(
    host: &C,
    ids: &NcclIds,
    shape: &AttnShape,
    rounds: &[Round],
    shards: &[Vec<[TypedVec; 2]>],
    stale: &[Vec<[TypedVec; 2]>],
) -> Result<u64> {
    let (me, p) = (host.rank(), host.size());
    let dtype = DType::Bf16;
    let token_bytes = shape.kv_token_bytes(dtype);
    let flat = CudaBackend::new(me)?;
    let paged = CudaBackend::new(me)?.with_paging(PAGE)?;
    let comm = NcclTransport::new(
        host,
        &flat,
        ids,
        NodeLayout::single(p),
        Strategy::Ring,
        TIMEOUT,
    )?;
    let mut sent = 0u64;
    for (n, round) in rounds.iter().enumerate() {
        let own_backend = if round.paged { &paged } else { &flat };
        let mut own = own_backend.alloc_kv(shape, dtype, round.tokens[me])?;
        let [k, v] = &shards[n][me];
        own_backend.write_kv(&mut own, 0, k, v)?;
        // The paged backend writes on a stream of its own; the hand-off reads on `flat`'s.
        own_backend.synchronize()?;
        let room = round.tokens.iter().copied().max().unwrap_or(0);
        let mut bufs = [
            flat.alloc_ring_kv(shape, dtype, room)?,
            flat.alloc_ring_kv(shape, dtype, room)?,
        ];
        let [stale_k, stale_v] = &stale[n][me];
        for buf in &mut bufs {
            flat.write_kv(buf, 0, stale_k, stale_v)?;
        }
        // What each receive buffer should hold: hop s receives into buffer s % 2, over what
        // the hop before last left.
        let mut held = [(); 2].map(|_| (stale_k.as_bytes().to_vec(), stale_v.as_bytes().to_vec()));
        for s in 0..p - 1 {
            let src = (me + p - s) % p;
            let from = (src + p - 1) % p;
            let (out_tokens, in_tokens) = (round.tokens[src], round.tokens[from]);
            let (cur, spare) = ring_buffers(s, &own, &mut bufs);
            comm.start_kv_exchange(&flat, cur, out_tokens, spare, in_tokens)?;
            comm.finish_kv_exchange(&flat, spare, in_tokens)?;
            sent += 2 * (out_tokens * token_bytes) as u64;
            let (k, v) = read_kv(&flat, host, spare, room, token_bytes)?;
            let split = in_tokens * token_bytes;
            let [wk, wv] = &shards[n][from];
            let want = &mut held[s % 2];
            want.0[..split].copy_from_slice(&wk.as_bytes()[..split]);
            want.1[..split].copy_from_slice(&wv.as_bytes()[..split]);
            let what = format!(
                "round {n} (paged {}), hop {s}: rank {me} from rank {from}",
                round.paged
            );
            assert!(
                k[..split] == want.0[..split] && v[..split] == want.1[..split],
                "{what}: the shard differs"
            );
            assert!(
                k[split..] == want.0[split..] && v[split..] == want.1[split..],
                "{what}: the buffer past the shard changed"
            );
        }
    }
    assert_eq!(
        comm.peer_ring_active(),
        Some(true),
        "the copy engines handed off"
    );
    assert_eq!(comm.own_traffic().bytes, sent, "the hand-offs' traffic");
    Ok(sent)
}

#[test]
fn shards_arrive_bit_for_bit_round_the_ring() {
    let Some(gpus) = peers::gpus(TEST) else {
        return;
    };
    // The path is opt-in; this test is its only user in this process.
    std::env::set_var(canopy_cuda::PEER_RING_SWITCH, "on");
    let mut rng = rng(TEST);
    // Llama's KV heads (8 of 128, bf16: 2 KiB a token of K): 4,096 tokens make a piece of the
    // copy engines' cut, so the larger rounds go in several pieces.
    let shape = AttnShape::new(32, 8, 128).unwrap();
    for p in 2..=gpus {
        let mut rounds: Vec<Round> = [
            (300usize, false),
            (9_000, true),
            (40_000, false),
            (700, true),
        ]
        .into_iter()
        .map(|(most, paged)| Round {
            tokens: (0..p).map(|_| rng.gen_range(most / 2..=most)).collect(),
            paged,
        })
        .collect();
        rounds[1].tokens[p - 1] = 0;
        let room = |r: &Round| r.tokens.iter().copied().max().unwrap_or(0);
        let mut random = |tokens: usize| random_kv(&mut rng, &shape, DType::Bf16, tokens);
        let shards: Vec<Vec<[TypedVec; 2]>> = rounds
            .iter()
            .map(|r| r.tokens.iter().map(|&t| random(t)).collect())
            .collect();
        // What the receive buffers hold before each round, every rank's own.
        let stale: Vec<Vec<[TypedVec; 2]>> = rounds
            .iter()
            .map(|r| (0..p).map(|_| random(room(r))).collect())
            .collect();
        let largest = rounds.iter().map(room).max().unwrap_or(0);
        let ids = NcclIds::new(1).expect("NCCL ids");
        let sent: Vec<u64> = ThreadWorld::run(p, TIMEOUT, |host| {
            rank(&host, &ids, &shape, &rounds, &shards, &stale)
        })
        .into_iter()
        .enumerate()
        .map(|(r, out)| out.unwrap_or_else(|e| panic!("p={p} rank {r}: {e}")))
        .collect();
        eprintln!(
            "  p={p}: {} rounds of shards up to {largest} tokens, every arrival bit for bit; {:.1} MB handed off by rank 0",
            rounds.len(),
            sent[0] as f64 / 1e6
        );
    }
}
