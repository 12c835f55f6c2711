#!/usr/bin/env bash
# Call 1: the flat RoPE items and the merge's first loads. compile-kernels and the device tests
# on the new build; the batch-64 pass traced, base and new in turn, twice; the 32K prefill of
# each (rope_split_store over 32K rows).
set -uo pipefail
source launch/device/env.sh
DEADLINE=560
{
  log "compile-kernels (new)"
  .device/canopy compile-kernels 2>&1 | tail -3
  device_tests > /dev/null
  cat "$OUT/tests.txt" | grep -E "test result|panicked|false"
  for round in 1 2; do
    for b in base canopy; do
      log "batch pass, $b, round $round"
      CANOPY_BIN=.device/$b OUT=$OUT/bt-$b-$round bash launch/device/batch-timeline.sh > /dev/null 2>&1
      grep -E "rope_split_store|merge_partials|decode_partial_mma|rms_norm|swiglu|window:" "$OUT/bt-$b-$round/batch-steps.txt"
    done
  done
  for b in base canopy base canopy; do
    log "prefill 32K, $b"
    .device/$b bench decode --arch llama-3.1-8b --random-weights --context 32K --decode 5 \
      --backend cuda 2>&1 | grep -E "^ *32|prefill|ms/token" | tail -3
  done
} 2>&1 | tee "$OUT/call1.txt"
