#!/usr/bin/env bash
# The ring's hand-off under NCCL's point-to-point settings (multi-GPU kinds): `bench scaling
# --strategy ring` (32/8 heads x 128, bf16, 10 iterations, no check) at RANKS (default 2 and
# the machine's GPU count) for each setting in SETTINGS (space-separated VAR=VALUE, "-" for
# NCCL's defaults; defaults first and last, so drift shows), then `bench decode --strategy
# ring` (8B shape, random weights and context) at the largest rank count for the settings in
# DECODE_SETTINGS. Session 40 found no setting that moves the ring at 2 ranks, and a rank's
# hand-off at half the rate at 4 ranks (BENCHMARKS). Results: $OUT/log.txt, one line a run.
set -uo pipefail
source "$(dirname "$0")/env.sh"
DEADLINE=${DEADLINE:-500}
G=$(nvidia-smi --list-gpus | wc -l)
RANKS=${RANKS:-$( [ "$G" -gt 2 ] && echo "2 $G" || echo 2 )}
SETTINGS=${SETTINGS:-"- NCCL_MIN_P2P_NCHANNELS=16 NCCL_MIN_P2P_NCHANNELS=32 NCCL_P2P_NVL_CHUNKSIZE=2097152 -"}
DECODE_SETTINGS=${DECODE_SETTINGS:-"- NCCL_MIN_P2P_NCHANNELS=32"}
# with SETTING COMMAND...: COMMAND under SETTING ("-": no change).
with() { local s=$1; shift; if [ "$s" = - ]; then "$@"; else env "$s" "$@"; fi; }
{
  nvidia-smi --query-gpu=index,name --format=csv,noheader
  $BIN compile-kernels > /dev/null 2>&1
  for p in $RANKS; do
    for s in $SETTINGS; do
      [ "$(left)" -lt 60 ] && { echo "SKIPPED scaling p=$p $s (time)"; continue; }
      with "$s" $BIN bench scaling --backend cuda --ranks "$p" --strategy ring --heads 32 --kv-heads 8 \
        --head-dim 128 --dtype bf16 --seq-lens 131072,1048576 --iters 10 --check-max-tokens 0 \
        --json 2>> "$OUT/err.txt" | python3 -c 'import json, sys
try:
    r = json.load(sys.stdin)
except ValueError:
    sys.exit(f"FAILED {sys.argv[1]} (err.txt)")
print("scaling", sys.argv[1], [(x["ranks"], x["seq_len"], round(x["median_ms"], 3)) for x in r["rows"] if x["ranks"] > 1])' "$s"
    done
  done
  p=${RANKS##* }
  for s in $DECODE_SETTINGS; do
    [ "$(left)" -lt 60 ] && { echo "SKIPPED decode $s (time)"; continue; }
    with "$s" $BIN bench decode --arch llama-3.1-8b --random-weights --context-fill random \
      --context 32K,128K --ranks "$p" --strategy ring --decode 10 --json 2>> "$OUT/err.txt" \
      | python3 -c 'import json, sys
try:
    r = json.load(sys.stdin)
except ValueError:
    sys.exit(f"FAILED {sys.argv[1]} (err.txt)")
print("decode", sys.argv[1], [(x["ranks"], x["context"], round(x["decode_ms_per_token"], 2)) for x in r["rows"]])' "$s"
  done
} 2>&1 | tee "$OUT/log.txt"
