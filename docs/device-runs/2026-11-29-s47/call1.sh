#!/usr/bin/env bash
# Session 47, call 1 (one H200): the output projection's weight prefetched into L2 during the
# attention by a kernel of its own (variants/l2-prefetch.md; CANOPY_L2_PREFETCH=MB,PIECE_KB,CTAS,MIN_ROWS),
# generate --n 64 over a random 4K prompt (8B shape, random weights), and batch 1 at 8K.
set -uo pipefail
source launch/device/env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$BIN compile-kernels > /dev/null 2>&1 || echo "compile-kernels FAILED"
run() { # NAME N CONTEXT TOKENS
  local name=$1; shift
  local line
  line=$($BIN generate --arch llama-3.1-8b --random-weights --context-fill random --context "$2" --n "$1" --max-tokens "$3" 2>&1 >/dev/null | grep -E "ms/token|rror" | tail -1)
  echo "$name n=$1 ctx=$2: $line"
}
for round in 1 2; do
  for v in off 64,64,132,9 16,64,132,9 64,16,132,9 64,256,264,9; do
    if [ $v = off ]; then unset CANOPY_L2_PREFETCH; else export CANOPY_L2_PREFETCH=$v; fi
    run "r$round $v" 64 4K 48
  done
done
for v in off 64,64,132,1; do
  if [ $v = off ]; then unset CANOPY_L2_PREFETCH; else export CANOPY_L2_PREFETCH=$v; fi
  run "$v" 1 8K 48
done
