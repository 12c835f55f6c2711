#!/usr/bin/env bash
# Call 2: the build of d7d780f with a debug line where a replan does not fit its buffers
# (`new`) against a6255e3 (`base`): few-shot and multi-chain at 40 a second with the CUDA
# backend's debug lines (why a kept size's plan was made anew), then few-shot all at once in
# two rounds, the order swapped.
set -uo pipefail
source launch/device/env.sh
DEADLINE=585
{
  log "served at 40 a second, new first"
  RUST_LOG=canopy_runtime=debug,canopy_cuda=debug RATES="40" TESTS= OUT=$OUT/r1 \
    DATASETS="few-shot multi-chain" BINS="new=.device/canopy base=.device/base" \
    bash launch/device/arrivals-ab.sh
  grep -E "^==|tokens/s|decode steps" "$OUT/r1/rate-40.txt"
  for order in "new=.device/canopy base=.device/base" "base=.device/base new=.device/canopy"; do
    log "few-shot all at once: $order"
    RATES="inf" TESTS= OUT=$OUT/r2 DATASETS="few-shot" BINS="$order" \
      bash launch/device/arrivals-ab.sh
    grep -E "^==|tokens/s|decode steps" "$OUT/r2/rate-inf.txt"
    mv "$OUT/r2" "$OUT/r2-${order%%=*}"
  done
  log "done"
  cd "$OUT" && tar czf runs.tgz r1 r2-* && rm -rf r1 r2-*
} 2>&1 | tee "$OUT/call2.txt"
