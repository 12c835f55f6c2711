#!/usr/bin/env bash
# Call 8: the 32K prefill with rms_norm reading its norm weights before the wait (b-rms, the
# embedded sources of 868ea17) against f7c5dfa's layers.cu (a-base), three rounds in turn.
set -uo pipefail
source launch/device/env.sh
{
  for round in 1 2 3; do
    for v in a-base b-rms; do
      log "prefill 32K, $v, round $round"
      CANOPY_KERNEL_SOURCES=.device/variants/$v .device/canopy bench decode --arch llama-3.1-8b \
        --random-weights --context 32K --decode 3 --backend cuda 2>&1 | grep -E "^ *32768"
    done
  done
} 2>&1 | tee "$OUT/call8.txt"
