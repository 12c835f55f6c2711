#!/usr/bin/env bash
# Exposed graph-launch latency (experiment): each replay launched twice, events around both.
set -uo pipefail
source "$(dirname "$0")/env.sh"
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  $BIN compile-kernels > /dev/null 2>&1
  for ctx in 8K 32K; do
    log "bench decode $ctx plain"
    RUST_LOG=canopy_runtime=debug $BIN bench decode --arch llama-3.1-8b --random-weights --context-fill random --context $ctx --ranks 1 --strategy tree --decode 20 2>&1 | grep -E "decode step|ms/tok|floor|^\|" | tail -14
    log "bench decode $ctx probe"
    CANOPY_REPLAY_PROBE=1 $BIN bench decode --arch llama-3.1-8b --random-weights --context-fill random --context $ctx --ranks 1 --strategy tree --decode 20 2>&1 | grep replay-probe | tail -8
  done
  log "generate n64 plain"
  RUST_LOG=canopy_runtime=debug $BIN generate --arch llama-3.1-8b --random-weights --context-fill random --context 4K --n 64 --max-tokens 24 2>&1 | grep -E "decode step|ms/token" | tail -10
  log "generate n64 probe"
  CANOPY_REPLAY_PROBE=1 $BIN generate --arch llama-3.1-8b --random-weights --context-fill random --context 4K --n 64 --max-tokens 24 2>&1 | grep -E "replay-probe|ms/token" | tail -10
} 2>&1 | tee "$OUT/probe.txt"
