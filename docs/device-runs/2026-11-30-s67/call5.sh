#!/usr/bin/env bash
# Call 5: the build of 1412c42 (the CUDA cores' kernel launched over its plan's groups' room):
# `sampling-check.sh` (the device tests; the tiny f32 model served against `generate`, whose
# f32 KV runs the CUDA cores' kernel; every request field against the CPU; model-check), then
# the conformance suite on the GPU (`selftest --backend cuda --ranks 1,2 --cases 1`: every
# planner, replans in place among them, f32, f16 and bf16 KV, contiguous and paged).
set -uo pipefail
source launch/device/env.sh
{
  log "sampling-check"
  DEADLINE=300 OUT=$OUT/check bash launch/device/sampling-check.sh > /dev/null 2>&1
  grep -E "test result|FAILED|panicked" "$OUT/check/tests.txt"
  grep -E "ALL PASS|FAILED|DIFFERENT|== " "$OUT/check/check.txt" | head -30
  log "selftest"
  timeout 200 $BIN selftest --backend cuda --ranks 1,2 --cases 1 > "$OUT/selftest.txt" 2>&1
  echo "exit $?"; grep -iE "passed|failed" "$OUT/selftest.txt" | tail -5
  log "done"
  cd "$OUT" && tar czf runs.tgz check selftest.txt && rm -rf check
} 2>&1 | tee "$OUT/call5.txt"
