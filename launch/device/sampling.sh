#!/usr/bin/env bash
# Decode logits narrowed on the device (issues 23 and 24): the layer-op tests (top_logits
# against the CPU bit for bit, beside every other op), the replay-equals-eager test (its
# steps now narrow to the top two inside the graph), then `bench decode` of this build
# against .device/canopy-base (the build before, which downloads whole rows) on the 8B, 1B
# and SmolLM2 shapes, ROUNDS times in turn. Results under $OUT.
set -uo pipefail
source "$(dirname "$0")/env.sh"
DEADLINE=${DEADLINE:-540}
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  log "layer ops"
  .device/layer_ops --nocapture top_logits 2>&1 | tail -24
  .device/layer_ops 2>&1 | tail -4
  log "replay against eager"
  .device/cuda_graphs --nocapture 2>&1 | tail -12
} 2>&1 | tee "$OUT/tests.txt"
log "bench decode, this build against the base"
BINS="new=$BIN base=.device/canopy-base" ARCHS=${ARCHS:-llama-3.1-8b llama-3.2-1b smollm2-135m} \
  DECODE=${DECODE:-30} OUT=$OUT/ab DEADLINE=$((DEADLINE - SECONDS - 30)) \
  bash "$(dirname "$0")/ab-decode.sh" > /dev/null
cat "$OUT/ab/ab.jsonl"
grep -h "SKIPPED\|FAILED" "$OUT/ab/log.txt"
