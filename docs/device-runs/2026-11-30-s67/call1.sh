#!/usr/bin/env bash
# Call 1: the session's build (`new`: decode rows padded to batch sizes, plans written over in
# place, recordings keyed by the attention's generation) against session 66's last (`base`,
# 019ebff): sampling-check.sh on `new` (the device tests among it); few-shot, multi-doc and
# multi-chain served at 40 a second and all at once (arrivals-ab.sh, 192 requests), then
# few-shot and multi-doc again with the order swapped; batch-1 decode (ab-decode.sh, 8B
# shape, 8K and 32K).
set -uo pipefail
source launch/device/env.sh
DEADLINE=585
{
  log "sampling-check (new)"
  DEADLINE=200 OUT=$OUT/check bash launch/device/sampling-check.sh > /dev/null 2>&1
  grep -E "test result|FAILED|panicked" "$OUT/check/tests.txt"
  tail -25 "$OUT/check/check.txt"
  log "served, new first"
  RATES="40 inf" TESTS= OUT=$OUT/r1 DATASETS="few-shot multi-doc multi-chain" \
    BINS="new=.device/canopy base=.device/base" bash launch/device/arrivals-ab.sh
  grep -E "^==|tokens/s|decode steps|prefill" "$OUT/r1/rate-40.txt" "$OUT/r1/rate-inf.txt"
  log "served, base first"
  RATES="40 inf" TESTS= OUT=$OUT/r2 DATASETS="few-shot multi-doc" \
    BINS="base=.device/base new=.device/canopy" bash launch/device/arrivals-ab.sh
  grep -E "^==|tokens/s|decode steps|prefill" "$OUT/r2/rate-40.txt" "$OUT/r2/rate-inf.txt"
  log "batch-1 decode"
  ARCHS=llama-3.1-8b CONTEXTS=8K,32K ROUNDS=1 DEADLINE=$((DEADLINE - SECONDS - 45)) OUT=$OUT/ab \
    BINS="new=.device/canopy base=.device/base" bash launch/device/ab-decode.sh > /dev/null 2>&1
  cat "$OUT/ab/ab.jsonl"
  log "done"
  cd "$OUT" && tar czf runs.tgz r1 r2 ab check && rm -rf r1 r2 ab check
} 2>&1 | tee "$OUT/call1.txt"
