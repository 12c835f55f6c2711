#!/usr/bin/env bash
# Call 3: the norm weights read before the wait. One binary (the build of the working tree,
# whose rms_norm reads them early), kernel sources as variants (CANOPY_KERNEL_SOURCES):
# a-base = f7c5dfa's layers.cu; b-rms = the embedded sources; c-rms-gemv = b-rms with the
# normed GEMV's staging reading its norm weights with the first row. The device tests on b-rms
# and on c-rms-gemv (layer ops: the normed GEMV against rms_norm then the GEMV, bit for bit);
# the batch-64 pass traced for a-base and b-rms, twice; batch-1 decode at 8K and 32K for each.
set -uo pipefail
source launch/device/env.sh
DEADLINE=560
{
  .device/canopy compile-kernels 2>&1 | tail -1
  device_tests > /dev/null
  grep -E "test result|panicked|false" "$OUT/tests.txt"
  log "layer-op tests on c-rms-gemv"
  CANOPY_KERNEL_SOURCES=.device/variants/c-rms-gemv .device/layer_ops --test-threads 1 2>&1 \
    | grep -E "test result|panicked|bit for bit: false"
  for round in 1 2; do
    for v in a-base b-rms; do
      log "batch pass, $v, round $round"
      CANOPY_KERNEL_SOURCES=.device/variants/$v OUT=$OUT/bt-$v-$round bash launch/device/batch-timeline.sh > /dev/null 2>&1
      grep -E "rms_norm|window:" "$OUT/bt-$v-$round/batch-steps.txt"
    done
  done
  log "batch-1 decode"
  CONTEXTS=8K,32K DECODE=60 ROUNDS=3 DEADLINE=$((DEADLINE - SECONDS)) OUT=$OUT/b1 \
    bash launch/device/kernel-variants.sh > /dev/null 2>&1
  cat "$OUT/b1/variants.jsonl"
  log "done"
} 2>&1 | tee "$OUT/call3.txt"
