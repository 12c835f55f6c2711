#!/usr/bin/env bash
# Call 3: the build of 4a2ee0e (the CPU decode kernel's products on gemm from 16 rows; the
# CPU is every device test's oracle): sampling-check.sh (the device tests, the tiny model
# served on the GPU against `generate`, every request field on the GPU against the CPU,
# `generate --logprobs` on the GPU against the CPU, transformers' model check).
set -uo pipefail
source launch/device/env.sh
{
  log "sampling-check"
  DEADLINE=420 OUT=$OUT/check bash launch/device/sampling-check.sh > /dev/null 2>&1
  grep -E "test result|FAILED|panicked|SEED" "$OUT/check/tests.txt"
  tail -30 "$OUT/check/check.txt"
  log "done"
  cd "$OUT" && tar czf runs.tgz check && rm -rf check
} 2>&1 | tee "$OUT/call3.txt"
