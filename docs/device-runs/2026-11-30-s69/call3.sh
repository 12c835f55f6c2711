#!/usr/bin/env bash
# Call 3: the build of the page tables' room (`new`) against 1fed82d (`base`):
# 1. the layer-op tests from an empty kernel cache, then `dense_ops_match_the_cpu` on 40 fresh
#    seeds (call 1 saw it fail once; its seed was not kept), each failure's message whole;
# 2. the attention-block and graph tests;
# 3. few-shot, multi-doc and multi-chain at 40 a second, `base` first, debug lines; then the
#    same, `new` first; then few-shot all at once, `base` first.
set -uo pipefail
source launch/device/env.sh
{
  rm -rf "$CANOPY_KERNEL_CACHE"
  log "layer-op tests, empty kernel cache"
  .device/layer_ops --test-threads 1 > "$OUT/layer-ops.txt" 2>&1
  grep -E "^test |test result|panicked|SEED" "$OUT/layer-ops.txt"
  log "dense_ops_match_the_cpu on 40 seeds"
  for i in $(seq 1 40); do
    .device/layer_ops dense_ops_match_the_cpu --nocapture > "$OUT/dense.txt" 2>&1 \
      || { grep -E "SEED|panicked" -A2 "$OUT/dense.txt"; cp "$OUT/dense.txt" "$OUT/dense-failed-$i.txt"; }
  done
  log "attention-block and graph tests"
  .device/attention_blocks --test-threads 1 2>&1 | grep -E "test result|panicked"
  .device/cuda_graphs 2>&1 | grep -E "test result|panicked"
  rm -f "$OUT/dense.txt"
  log "served at 40 a second, base first"
  RUST_LOG=canopy_runtime=debug,canopy_cuda=debug RATES="40" TESTS= OUT=$OUT/r1 \
    DATASETS="few-shot multi-doc multi-chain" BINS="base=.device/base new=.device/canopy" \
    bash launch/device/arrivals-ab.sh
  grep -E "^==|tokens/s|decode steps" "$OUT/r1/rate-40.txt"
  log "served at 40 a second, new first"
  RATES="40" TESTS= OUT=$OUT/r2 DATASETS="few-shot multi-doc multi-chain" \
    BINS="new=.device/canopy base=.device/base" bash launch/device/arrivals-ab.sh
  grep -E "^==|tokens/s|decode steps" "$OUT/r2/rate-40.txt"
  log "few-shot all at once, base first"
  RATES="inf" TESTS= OUT=$OUT/r3 DATASETS="few-shot" \
    BINS="base=.device/base new=.device/canopy" bash launch/device/arrivals-ab.sh
  grep -E "^==|tokens/s|decode steps" "$OUT/r3/rate-inf.txt"
  log "done"
  cd "$OUT" && tar czf runs.tgz r1 r2 r3 && rm -rf r1 r2 r3
} 2>&1 | tee "$OUT/call3.txt"
