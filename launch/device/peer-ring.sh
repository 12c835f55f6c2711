#!/usr/bin/env bash
# The ring's hand-off on the copy engines over the peers' memory (multi-GPU kinds; opt-in,
# CANOPY_PEER_RING=on), against the same hand-off through NCCL (off), on, off, on so drift
# shows. PART lists the
# parts, in order (default: all):
#   test     the peer ring's test binary (.device/peer_ring): shards round the ring at 2 to G
#            ranks, every arrival bit for bit, contiguous and paged, growing slots;
#   scaling  `bench scaling --strategy ring` (32/8 heads x 128, bf16) at 2 and G ranks, 128K and
#            1M, checked against the f64 oracle, with the hand-off's own bandwidth;
#   decode   `bench decode --strategy ring` (8B shape, random weights and context) at 2 and G
#            ranks, 32K and 128K, threads;
#   mpi      the same at G ranks under `mpirun -np G` at 32K (peers in other processes: the
#            slots are mapped by IPC handle);
#   check    model-check's fixtures on the ring at 2 and G ranks, against transformers and one
#            rank, the copy engines on;
#   stall    the watchdog with the copy engines: rank 1 stops before its first step and the
#            others must fail within --timeout (5 s), as threads and under mpirun.
# SWITCHES (default "on off on") orders the A/B of scaling and decode; CHECK_CASES the check's
# fixture cases. Results: $OUT/log.txt, one line a run; the reports in $OUT/runs.tgz.
set -uo pipefail
source "$(dirname "$0")/env.sh"
DEADLINE=${DEADLINE:-560}
G=${G:-$(nvidia-smi --list-gpus | wc -l)}
PARTS=(${PART:-test scaling decode mpi check stall})
RUNS=$OUT/runs
mkdir -p "$RUNS"
trap 'tar czf "$OUT/runs.tgz" -C "$OUT" runs && rm -rf "$RUNS"' EXIT
ARCH=(--arch llama-3.1-8b --random-weights --context-fill random --decode 10 --strategy ring)
MPIRUN=(mpirun --allow-run-as-root -np "$G" -x NCCL_NVLS_ENABLE -x LD_LIBRARY_PATH -x CANOPY_KERNEL_CACHE -x CANOPY_PEER_RING)
RANKS=$( [ "$G" -gt 2 ] && echo "2,$G" || echo 2 )
SWITCHES=${SWITCHES:-on off on}
CHECK_CASES=${CHECK_CASES:-f32:1:tree f32:2:ring f32:$G:ring bf16:$G:ring}
switched() { switched_run CANOPY_PEER_RING "$RUNS" "$@"; }
{
  nvidia-smi --query-gpu=index,name --format=csv,noheader
  $BIN compile-kernels > /dev/null 2>&1
  for part in "${PARTS[@]}"; do
    case $part in
    test)
      log "peer ring test"
      .device/peer_ring --nocapture 2>&1 | grep -A1 -E "^test |test result|panicked|p=|skipped"
      ;;
    scaling)
      for sw in $SWITCHES; do
        switched scaling $sw $BIN bench scaling --backend cuda --ranks "$RANKS" --strategy ring --heads 32 \
          --kv-heads 8 --head-dim 128 --dtype bf16 --seq-lens 131072,1048576 --iters 10 \
          --check-max-tokens 1048576
      done
      ;;
    decode)
      for sw in $SWITCHES; do
        switched decode $sw $BIN bench decode "${ARCH[@]}" --context 32K,128K --ranks "$RANKS"
      done
      ;;
    mpi)
      for sw in on off; do
        switched mpi $sw "${MPIRUN[@]}" $BIN bench decode "${ARCH[@]}" --context 32K
      done
      ;;
    check)
      log "model-check: the tiny fixtures on the ring (one GPU a rank)"
      CANOPY_PEER_RING=on OUT=$RUNS/check STAGES=fixtures DEADLINE=$(($(left) - 10)) \
        FIXTURE_CASES="$CHECK_CASES" \
        bash "$(dirname "$0")/model-check.sh" > /dev/null 2>&1
      tail -1 "$RUNS/check/model-check-log.txt"
      ;;
    stall)
      (export CANOPY_PEER_RING=on; stall_runs "$RUNS" --strategy ring)
      ;;
    esac
  done
} 2>&1 | tee "$OUT/log.txt"
