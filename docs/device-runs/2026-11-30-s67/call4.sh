#!/usr/bin/env bash
# Call 4 (nvidia-h200-x2): call 3's two memcheck runs on 2 ranks (one a GPU, NCCL) again with
# the CUDA API's returned errors left out (`--report-api-errors no`: NCCL's own probes of kernel
# images and of peer access were all call 3 printed), to see whether any access error remains;
# then few-shot at 40 a second on 2 ranks, `base` first this time.
set -uo pipefail
source launch/device/env.sh
SAN=/usr/local/cuda-13.0/bin/compute-sanitizer
FIX=tests/fixtures/tiny
{
  for strategy in tree ring; do
    log "memcheck, 2 ranks, $strategy"
    "$SAN" --tool memcheck --report-api-errors no --error-exitcode 9 --print-limit 20 $BIN generate \
      --backend cuda --prompt-ids 1,5,9,13,2,7,11 --max-tokens 8 --temperature 0 \
      --model $FIX/gqa-hd64 --dtype bf16 --ranks 2 --strategy $strategy > "$OUT/memcheck-r2-$strategy.txt" 2>&1
    echo "exit $?"; grep "ERROR SUMMARY" "$OUT/memcheck-r2-$strategy.txt"
  done
  log "few-shot at 40 a second, 2 ranks, base first"
  MODEL="--arch llama-3.1-8b --random-weights --backend cuda --max-context 20480 --kv-tokens 131072 --ranks 2" \
    RATES="40" TESTS= OUT=$OUT/r1 DATASETS="few-shot" \
    BINS="base=.device/base held=.device/canopy" bash launch/device/arrivals-ab.sh
  grep -E "^==|tokens/s|decode steps" "$OUT/r1/rate-40.txt"
  log "done"
  cd "$OUT" && tar czf runs.tgz r1 memcheck-*.txt && rm -rf r1
} 2>&1 | tee "$OUT/call4.txt"
