#!/usr/bin/env bash
# Call 6 (nvidia-h200-x2): the build of e4f943f (`new`) against a6255e3 (`base`) on 2 ranks, one
# GPU each (the tree over NCCL; the ranks vote on each step's recording): few-shot and
# multi-doc at 40 a second, `new` first, then few-shot with `base` first.
set -uo pipefail
source launch/device/env.sh
M2="--arch llama-3.1-8b --random-weights --backend cuda --max-context 20480 --kv-tokens 131072 --ranks 2"
{
  log "40 a second, 2 ranks, new first"
  MODEL="$M2" RATES="40" TESTS= OUT=$OUT/r1 DATASETS="few-shot multi-doc" \
    BINS="new=.device/canopy base=.device/base" bash launch/device/arrivals-ab.sh
  grep -E "^==|tokens/s|decode steps" "$OUT/r1/rate-40.txt"
  log "few-shot, 2 ranks, base first"
  MODEL="$M2" RATES="40" TESTS= OUT=$OUT/r2 DATASETS="few-shot" \
    BINS="base=.device/base new=.device/canopy" bash launch/device/arrivals-ab.sh
  grep -E "^==|tokens/s|decode steps" "$OUT/r2/rate-40.txt"
  log "done"
  cd "$OUT" && tar czf runs.tgz r1 r2 && rm -rf r1 r2
} 2>&1 | tee "$OUT/call6.txt"
