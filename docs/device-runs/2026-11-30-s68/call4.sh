#!/usr/bin/env bash
# Call 4: the build of e4f943f (`new`: a recording and a decode attention kept for each of the
# last four batch sizes; the patience weighs only recordings whose own step changed) against
# a6255e3 (`base`): few-shot, multi-doc and multi-chain at 40 a second, `new` first, with the
# CUDA backend's debug lines; then the three with `base` first; then few-shot all at once,
# `base` first.
set -uo pipefail
source launch/device/env.sh
{
  log "served at 40 a second, new first"
  RUST_LOG=canopy_runtime=debug,canopy_cuda=debug RATES="40" TESTS= OUT=$OUT/r1 \
    DATASETS="few-shot multi-doc multi-chain" BINS="new=.device/canopy base=.device/base" \
    bash launch/device/arrivals-ab.sh
  grep -E "^==|tokens/s|decode steps" "$OUT/r1/rate-40.txt"
  log "served at 40 a second, base first"
  RATES="40" TESTS= OUT=$OUT/r2 DATASETS="few-shot multi-doc multi-chain" \
    BINS="base=.device/base new=.device/canopy" bash launch/device/arrivals-ab.sh
  grep -E "^==|tokens/s|decode steps" "$OUT/r2/rate-40.txt"
  log "few-shot all at once, base first"
  RATES="inf" TESTS= OUT=$OUT/r3 DATASETS="few-shot" \
    BINS="base=.device/base new=.device/canopy" bash launch/device/arrivals-ab.sh
  grep -E "^==|tokens/s|decode steps" "$OUT/r3/rate-inf.txt"
  log "done"
  cd "$OUT" && tar czf runs.tgz r1 r2 r3 && rm -rf r1 r2 r3
} 2>&1 | tee "$OUT/call4.txt"
