#!/usr/bin/env bash
# Call 9: rms_norm's early norm weights held as stored (16-bit ones two to a register:
# c-packed) against f32 registers (b-rms, 868ea17's embedded sources) and none (a-base,
# f7c5dfa's layers.cu): the layer-op tests on c-packed, the 32K prefill of each, three rounds
# in turn, and the batch-64 pass traced for b-rms and c-packed, twice.
set -uo pipefail
source launch/device/env.sh
{
  log "layer-op tests on c-packed"
  CANOPY_KERNEL_SOURCES=.device/variants/c-packed .device/layer_ops --test-threads 1 2>&1 \
    | grep -E "test result|panicked|bit for bit: false"
  for round in 1 2 3; do
    for v in a-base b-rms c-packed; do
      log "prefill 32K, $v, round $round"
      CANOPY_KERNEL_SOURCES=.device/variants/$v .device/canopy bench decode --arch llama-3.1-8b \
        --random-weights --context 32K --decode 3 --backend cuda 2>&1 | grep -E "^ *32768"
    done
  done
  for round in 1 2; do
    for v in b-rms c-packed; do
      log "batch pass, $v, round $round"
      CANOPY_KERNEL_SOURCES=.device/variants/$v OUT=$OUT/bt-$v-$round bash launch/device/batch-timeline.sh > /dev/null 2>&1
      grep -E "rms_norm|window:" "$OUT/bt-$v-$round/batch-steps.txt"
    done
  done
} 2>&1 | tee "$OUT/call9.txt"
