#!/usr/bin/env bash
# Call 6: `dense_ops_match_the_cpu` (the layer-op test that failed once in call 1) run again
# and again on fresh seeds for 420 s, half of the runs from an empty kernel cache (as call 1's
# was); each failure's whole output kept with its seed.
set -uo pipefail
source launch/device/env.sh
{
  pass=0 fail=0 i=0
  while [ $SECONDS -lt 420 ]; do
    i=$((i + 1))
    [ $((i % 2)) -eq 0 ] && rm -rf "$CANOPY_KERNEL_CACHE"
    if .device/layer_ops dense_ops_match_the_cpu --nocapture > "$OUT/dense.txt" 2>&1; then
      pass=$((pass + 1))
    else
      fail=$((fail + 1))
      cp "$OUT/dense.txt" "$OUT/dense-failed-$i.txt"
      grep -E "SEED|panicked" -A1 "$OUT/dense.txt"
    fi
  done
  rm -f "$OUT/dense.txt"
  log "$pass passed, $fail failed"
} 2>&1 | tee "$OUT/call6.txt"
