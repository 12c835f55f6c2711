#!/usr/bin/env bash
# Call 5: merge_partials with the first partial rows' loads beside the lse loads, as kernel
# source variants of the build of 868ea17: m0 = the embedded merge.cu; m1 = the loads, the deep
# merge built for two CTAs an SM (so the held rows fit its registers); m2 = m1 with twelve rows
# held (every row of a batch-64 few-shot cell). The attention-block tests on m1 and m2, then the
# batch-64 pass traced for each, twice.
set -uo pipefail
source launch/device/env.sh
{
  for v in m1 m2; do
    log "attention-block tests, $v"
    CANOPY_KERNEL_SOURCES=.device/variants/$v .device/attention_blocks --test-threads 1 2>&1 \
      | grep -E "test result|panicked|max error"
  done
  for round in 1 2; do
    for v in m0 m1 m2; do
      log "batch pass, $v, round $round"
      CANOPY_KERNEL_SOURCES=.device/variants/$v OUT=$OUT/bt-$v-$round bash launch/device/batch-timeline.sh > /dev/null 2>&1
      grep -E "merge_partials|decode_partial_mma|window:" "$OUT/bt-$v-$round/batch-steps.txt"
    done
  done
  log "done"
} 2>&1 | tee "$OUT/call5.txt"
