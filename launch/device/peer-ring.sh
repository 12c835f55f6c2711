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
#            rank, the copy engines on (CHECK_JOBS cases at once, default 4), with the rest of
#            the deadline as the phase's limit; every case not passed (failed, errored or not
#            reached for time) is listed, with the phase's count of cases run and skipped;
#   same     `canopy generate` on the committed tiny models, ring at G ranks as threads and
#            under mpirun, f32 and bf16, copy engines on against off at once: tokens and logits
#            must be the same bits, and the "on" run must have logged the copy engines' set-up;
#   stall    the watchdog with the copy engines: rank 1 stops before its first step and the
#            others must fail within --timeout (5 s), as threads and under mpirun.
# check and same need a GPU a rank (G at most the machine's GPUs): ranks that share a GPU
# exchange through the GPU's own streams or the host, never the copy engines' path.
# SWITCHES (default "on off on") orders the A/B of scaling and decode; CHECK_CASES the check's
# fixture cases. Results: $OUT/log.txt, one line a run; the reports in $OUT/runs.tgz.
set -uo pipefail
source "$(dirname "$0")/env.sh"
DEADLINE=${DEADLINE:-560}
switch_ab CANOPY_PEER_RING
GPUS=$(nvidia-smi --list-gpus | wc -l)
# one_gpu_a_rank PART: true where G ranks get a GPU each, else says why PART is skipped.
one_gpu_a_rank() {
  [ "$G" -le "$GPUS" ] && return 0
  log "SKIPPED $1: $G ranks on $GPUS GPU(s) share GPUs, and shared GPUs never take the copy engines' path"
  return 1
}
PARTS=(${PART:-test scaling decode mpi check same stall})
ARCH=(--arch llama-3.1-8b --random-weights --context-fill random --decode 10 --strategy ring)
RANKS=$( [ "$G" -gt 2 ] && echo "2,$G" || echo 2 )
SWITCHES=${SWITCHES:-on off on}
CHECK_CASES=${CHECK_CASES:-f32:1:tree f32:2:ring f32:$G:ring bf16:$G:ring}
# last_hops LOG: for each canopy call in model-check's stderr log that failed, each rank's last
# event of the ring's copy-engine path (its debug events: a hop starts, is enqueued; slots
# dropped), so that a hang shows which rank stopped where.
last_hops() {
  python3 - "$1" <<'PY'
import re, sys
case, failed, last = None, False, {}
def report():
    if case and failed:
        print(f"   {case}: " + ("; ".join(f"rank {r}: {last[r]}" for r in sorted(last)) or "no ring events"))
for line in open(sys.argv[1], errors="replace"):
    line = re.sub(r"\x1b\[[0-9;]*m", "", line)
    head = re.match(r"=== (\S+) \(exit, seconds: (\d+)", line)
    if head:
        report()
        case, failed, last = head[1], head[2] != "0", {}
        continue
    event = re.search(r"peer_ring: (.*?) rank=(\d+)(.*)", line)
    if event:
        last[int(event[2])] = (event[1] + event[3]).strip()[:90]
report()
PY
}
# same_bits DIR: each tiny model, f32 and bf16, a 33-token prompt, 32 tokens greedy: the ring
# at G ranks as threads and under mpirun, with the copy engines on and off at once; one line a
# pair, "same" where the samples (tokens and logits) are equal, and "NOT ENGAGED" where the "on"
# run did not log the copy engines' set-up (its comparison then proves nothing).
same_bits() {
  local dir=$1 model dtype how
  mkdir -p "$dir"
  for model in gqa-hd64 llama3-hd128 tied-mha-hd64; do for dtype in f32 bf16; do for how in threads mpi; do
    [ "$(left)" -lt 30 ] && { log "SKIPPED the rest (time)"; return; }
    local name=$model-$dtype-$how args=(generate --backend cuda --model tests/fixtures/tiny/$model
      --strategy ring --dtype $dtype --prompt-ids "$(seq -s, 3 35)" --max-tokens 32 --temperature 0
      --json --logits)
    for sw in on off; do
      if [ $how = threads ]; then cmd=($BIN "${args[@]}" --ranks "$G")
      else cmd=("${MPIRUN[@]}" $BIN "${args[@]}"); fi
      CANOPY_PEER_RING=$sw RUST_LOG=canopy_cuda::peer_ring=info timeout 60 "${cmd[@]}" \
        > "$dir/$name-$sw.json" 2> "$dir/$name-$sw.err" &
    done
    wait
    python3 - "$dir/$name" <<'PY'
import json, sys
stem = sys.argv[1]
try:
    on, off = (json.load(open(f"{stem}-{sw}.json"))["samples"] for sw in ("on", "off"))
except (ValueError, KeyError, OSError) as e:
    sys.exit(f"{stem.split('/')[-1]}: no report ({e})")
engaged = "runs on the copy engines" in open(f"{stem}-on.err", errors="replace").read()
print(f"{stem.split('/')[-1]}: {'same' if on == off else 'DIFFER'}"
      f"{'' if engaged else ' (NOT ENGAGED: the on run did not set the copy engines up)'}")
PY
  done; done; done
}
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
      one_gpu_a_rank check || continue
      log "model-check: the tiny fixtures on the ring (one GPU a rank)"
      CANOPY_PEER_RING=on RUST_LOG=canopy_cuda::peer_ring=debug OUT=$RUNS/check STAGES=fixtures \
        DEADLINE=$(($(left) - 10)) FIXTURE_LIMIT=$(($(left) - 30)) FIXTURE_CASES="$CHECK_CASES" \
        JOBS=${CHECK_JOBS:-4} bash "$(dirname "$0")/model-check.sh" > /dev/null 2>&1
      grep -E "^reference|^ranks|fixtures done in|case\(s\) \(counted" \
        "$RUNS/check/model-check-log.txt" | grep -v " pass " | head -40
      tail -1 "$RUNS/check/model-check-log.txt"
      last_hops "$RUNS/check/canopy-stderr.log"
      ;;
    same)
      one_gpu_a_rank same || continue
      log "the tiny models' tokens and logits, copy engines on against off"
      same_bits "$RUNS/same"
      ;;
    stall)
      (export CANOPY_PEER_RING=on; stall_runs "$RUNS" --strategy ring)
      ;;
    esac
  done
} 2>&1 | tee "$OUT/log.txt"
