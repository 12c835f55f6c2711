#!/usr/bin/env bash
# Decode steps replayed from a recorded CUDA graph (issue 23): the replay-equals-eager test,
# the layer-op tests, then `bench decode` with graphs against --eager (same binary, same
# call) on the 8B, 1B and SmolLM2 shapes. Results under $OUT.
set -uo pipefail
source "$(dirname "$0")/env.sh"
DEADLINE=${DEADLINE:-540}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
device_tests
log "bench decode, graphs against --eager"
BINS="graphs=$BIN eager=$BIN@--eager" ARCHS=${ARCHS:-llama-3.1-8b llama-3.2-1b smollm2-135m} \
  DECODE=${DECODE:-30} OUT=$OUT/ab DEADLINE=$((DEADLINE - 60)) bash "$(dirname "$0")/ab-decode.sh" > /dev/null
cat "$OUT/ab/ab.jsonl"
grep -h "SKIPPED\|FAILED" "$OUT/ab/log.txt"
