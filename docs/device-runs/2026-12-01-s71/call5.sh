#!/usr/bin/env bash
# Call 5: the CPU backend on the device machine's 16 cores (no GPU used): `final` (the build
# of 4a2ee0e's code) against `pf` (the same with the next block's f32 keys and values
# prefetched, a variant). SmolLM2's shape with random weights, `bench decode` with a random
# context of 2K, 8K and 32K (decode only), three rounds.
set -uo pipefail
source launch/device/env.sh
{
  for round in 1 2 3; do
    for b in final pf; do
      log "round $round, $b: bench decode"
      .device/$b bench decode --arch smollm2-135m --random-weights --backend cpu \
        --context 2K,8K,32K --context-fill random --decode 24 2>&1 | grep -E "^ *[0-9]+K? "
    done
  done
  log "done"
} 2>&1 | tee "$OUT/call5.txt"
