#!/usr/bin/env bash
# Call 1: the session's build (`new`: a plan's masks uploaded with room, a prefill's own step
# inputs grown without moving the graph epoch) against session 68's last (`base`, 1fed82d):
# the CUDA conformance suite (its replans among it) on 1 and 2 ranks; sampling-check.sh on
# `new` (the device tests among it); few-shot and multi-chain served at 40 a second, `new`
# first, with the CUDA backend's debug lines (what moved the epoch, which plans were made anew).
set -uo pipefail
source launch/device/env.sh
DEADLINE=585
{
  log "selftest (new)"
  timeout 120 $BIN selftest --backend cuda --ranks 1,2 --cases 1 2>&1 | grep -E "passed|FAIL|error" | tail -5
  log "sampling-check (new)"
  DEADLINE=200 OUT=$OUT/check bash launch/device/sampling-check.sh > /dev/null 2>&1
  grep -E "test result|FAILED|panicked" "$OUT/check/tests.txt"
  tail -25 "$OUT/check/check.txt"
  log "served at 40 a second, new first, debug lines"
  RUST_LOG=canopy_runtime=debug,canopy_cuda=debug RATES="40" TESTS= OUT=$OUT/r1 \
    DATASETS="few-shot multi-chain" BINS="new=.device/canopy base=.device/base" \
    bash launch/device/arrivals-ab.sh
  grep -E "^==|tokens/s|decode steps" "$OUT/r1/rate-40.txt"
  log "done"
  cd "$OUT" && tar czf runs.tgz r1 check && rm -rf r1 check
} 2>&1 | tee "$OUT/call1.txt"
