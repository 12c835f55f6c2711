#!/usr/bin/env bash
# Call 2: the flat RoPE items and SwiGLU as a programmatic dependent (`new`) against session
# 65's last build (`base`): the device tests and compile-kernels on `new`; the batch-64 pass
# traced, in turn, twice; then few-shot served all at once (arrivals-ab.sh, 192 requests), two
# rounds with the order swapped.
set -uo pipefail
source launch/device/env.sh
DEADLINE=560
{
  log "compile-kernels (new)"
  .device/canopy compile-kernels 2>&1 | tail -1
  device_tests > /dev/null
  grep -E "test result|panicked|false" "$OUT/tests.txt"
  for round in 1 2; do
    for b in base canopy; do
      log "batch pass, $b, round $round"
      CANOPY_BIN=.device/$b OUT=$OUT/bt-$b-$round bash launch/device/batch-timeline.sh > /dev/null 2>&1
      grep -E "rope_split_store|merge_partials|rms_norm|swiglu|window:" "$OUT/bt-$b-$round/batch-steps.txt"
    done
  done
  log "served, base first"
  RATES=inf TESTS= OUT=$OUT/r1 BINS="base=.device/base new=.device/canopy" bash launch/device/arrivals-ab.sh
  cat "$OUT/r1/rate-inf.txt" | grep -vE "^ *$" | head -40
  log "served, new first"
  RATES=inf TESTS= OUT=$OUT/r2 BINS="new=.device/canopy base=.device/base" bash launch/device/arrivals-ab.sh
  cat "$OUT/r2/rate-inf.txt" | grep -vE "^ *$" | head -40
  log "done"
} 2>&1 | tee "$OUT/call2.txt"
