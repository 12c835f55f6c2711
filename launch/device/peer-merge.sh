#!/usr/bin/env bash
# The tree's all-gather merge as one kernel over the peers' memory (multi-GPU kinds), against
# the same merge through NCCL (CANOPY_PEER_MERGE=off), on, off, on so drift shows. PART lists
# the parts, in order (default: all):
#   test     the peer merge's test binary (.device/peer_merge): against the fold after a
#            gathered all-gather, bit for bit, eager at three sizes and recorded and replayed;
#   scaling  `bench scaling` (32/8 heads x 128, bf16) at G ranks, allgather and auto, 128K and
#            1M, checked against the f64 oracle;
#   decode   `bench decode` (8B shape, random weights and context) at 1 and G ranks, 32K and
#            128K, allgather and auto, threads;
#   mpi      the same at G ranks under `mpirun -np G` at 32K (peers in other processes: the
#            memory is mapped by IPC handle);
#   check    model-check's fixtures at G ranks, tree and ring, against transformers and one
#            rank;
#   serve    serve.sh's check on G ranks: the tiny model served on the GPUs (batches of up to
#            12 requests, prefill chunks of 64 tokens) against `canopy generate` on the CPU;
#   stall    the watchdog with the peer merge: rank 1 stops before its first step and the
#            others must fail within --timeout (5 s), naming the rank and the call, as threads
#            and under mpirun.
# Results: $OUT/log.txt, one line a run; the reports in $OUT/runs.tgz.
set -uo pipefail
source "$(dirname "$0")/env.sh"
DEADLINE=${DEADLINE:-560}
switch_ab CANOPY_PEER_MERGE
PARTS=(${PART:-test scaling decode mpi check serve stall})
ARCH=(--arch llama-3.1-8b --random-weights --context-fill random --decode 10)
{
  nvidia-smi --query-gpu=index,name --format=csv,noheader
  $BIN compile-kernels > /dev/null 2>&1
  for part in "${PARTS[@]}"; do
    case $part in
    test)
      log "peer merge test"
      .device/peer_merge --nocapture 2>&1 | grep -E "^test |test result|panicked|p = |skipped|round 0 |round 7 "
      ;;
    scaling)
      for sw in on off on; do
        switched scaling $sw $BIN bench scaling --backend cuda --ranks "$G" --heads 32 --kv-heads 8 \
          --head-dim 128 --dtype bf16 --seq-lens 131072,1048576 --iters 20 --collective allgather,auto \
          --check-max-tokens 1048576
      done
      ;;
    decode)
      switched decode-1 on $BIN bench decode "${ARCH[@]}" --context 32K,128K --ranks 1
      for sw in on off on; do
        switched decode $sw $BIN bench decode "${ARCH[@]}" --context 32K,128K --ranks "$G" \
          --collective allgather,auto
      done
      ;;
    mpi)
      for sw in on off; do
        switched mpi $sw "${MPIRUN[@]}" $BIN bench decode "${ARCH[@]}" --context 32K --collective allgather
      done
      ;;
    serve)
      log "serve.sh's check on $G ranks"
      RUST_LOG=canopy_cuda=info CHECK_RANKS=$G DEADLINE=60 OUT=$RUNS bash "$(dirname "$0")/serve.sh" > "$RUNS/serve-log.txt" 2>&1
      grep -h "check:" "$RUNS/serve-log.txt" | tail -1
      grep -h -m2 -E "goes through NCCL|runs as one kernel" "$RUNS"/serve/server-tiny.log || echo "the server logged no merge path"
      ;;
    stall)
      stall_runs "$RUNS" --strategy tree --collective allgather
      ;;
    check)
      log "model-check: the tiny fixtures on $G ranks (one GPU each: NCCL)"
      OUT=$RUNS/check STAGES=fixtures DEADLINE=$(($(left) - 10)) \
        FIXTURE_CASES="f32:1:tree f32:$G:tree f32:$G:ring bf16:$G:tree" \
        bash "$(dirname "$0")/model-check.sh" > /dev/null 2>&1
      tail -1 "$RUNS/check/model-check-log.txt"
      ;;
    esac
  done
} 2>&1 | tee "$OUT/log.txt"
