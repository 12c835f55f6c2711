#!/usr/bin/env bash
# Call 3: the build of d7d780f with debug lines where a replan does not fit its buffers and
# where a buffer recorded passes read is made anew (the graph epoch moves): few-shot and
# multi-chain at 40 a second, `new` alone.
set -uo pipefail
source launch/device/env.sh
{
  RUST_LOG=canopy_runtime=debug,canopy_cuda=debug RATES="40" TESTS= OUT=$OUT/r1 \
    DATASETS="few-shot multi-chain" BINS="new=.device/canopy" bash launch/device/arrivals-ab.sh
  grep -E "^==|tokens/s|decode steps" "$OUT/r1/rate-40.txt"
  cd "$OUT" && tar czf runs.tgz r1 && rm -rf r1
} 2>&1 | tee "$OUT/call3.txt"
