#!/usr/bin/env bash
# Call 1: the session's build (`new`: a recording and a decode attention kept for each of the
# last four batch sizes) against session 67's last (`base`, a6255e3): sampling-check.sh on
# `new` (the device tests among it); few-shot, multi-doc and multi-chain served at 40 a second
# (arrivals-ab.sh, 192 requests), `new` first, then few-shot and multi-doc with `base` first,
# then few-shot all at once.
set -uo pipefail
source launch/device/env.sh
DEADLINE=585
{
  log "sampling-check (new)"
  DEADLINE=200 OUT=$OUT/check bash launch/device/sampling-check.sh > /dev/null 2>&1
  grep -E "test result|FAILED|panicked" "$OUT/check/tests.txt"
  tail -25 "$OUT/check/check.txt"
  log "served at 40 a second, new first"
  RATES="40" TESTS= OUT=$OUT/r1 DATASETS="few-shot multi-doc multi-chain" \
    BINS="new=.device/canopy base=.device/base" bash launch/device/arrivals-ab.sh
  grep -E "^==|tokens/s|decode steps" "$OUT/r1/rate-40.txt"
  log "served at 40 a second, base first"
  RATES="40" TESTS= OUT=$OUT/r2 DATASETS="few-shot multi-doc" \
    BINS="base=.device/base new=.device/canopy" bash launch/device/arrivals-ab.sh
  grep -E "^==|tokens/s|decode steps" "$OUT/r2/rate-40.txt"
  log "few-shot all at once"
  RATES="inf" TESTS= OUT=$OUT/r3 DATASETS="few-shot" \
    BINS="new=.device/canopy base=.device/base" bash launch/device/arrivals-ab.sh
  grep -E "^==|tokens/s|decode steps" "$OUT/r3/rate-inf.txt"
  log "done"
  cd "$OUT" && tar czf runs.tgz r1 r2 r3 check && rm -rf r1 r2 r3 check
} 2>&1 | tee "$OUT/call1.txt"
