#!/usr/bin/env bash
# Call 2: call 1's failing layer-op test again, three times, its failures' messages whole; then
# the CUDA conformance suite (its replans among them) on 1 and 2 ranks, with time to compile.
set -uo pipefail
source launch/device/env.sh
{
  for i in 1 2 3; do
    log "layer-op test dense_ops_match_the_cpu, run $i"
    .device/layer_ops dense_ops_match_the_cpu --nocapture > "$OUT/dense-$i.txt" 2>&1
    grep -E "panicked" -A3 "$OUT/dense-$i.txt"
    grep -E "test result" "$OUT/dense-$i.txt"
  done
  log "selftest (new)"
  timeout 400 $BIN selftest --backend cuda --ranks 1,2 --cases 1 > "$OUT/selftest.txt" 2>&1
  echo "rc=$?"
  tail -6 "$OUT/selftest.txt"
  log "done"
} 2>&1 | tee "$OUT/call2.txt"
