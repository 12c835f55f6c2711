#!/usr/bin/env bash
# Call 1: the two seeds on which session 69's `dense_ops_match_the_cpu` failed (its SwiGLU
# comparison), replayed with the new metric; then every device test (`graph_epoch` among them,
# its first run); then `dense_ops_match_the_cpu` again and again on fresh seeds until 480 s.
set -uo pipefail
source launch/device/env.sh
{
  for seed in 1796072147851013282 1796072124314553109; do
    log "seed $seed"
    CANOPY_TEST_SEED=$seed .device/layer_ops dense_ops_match_the_cpu --nocapture > "$OUT/seed-$seed.txt" 2>&1
    echo "exit $?"; grep -E "test result|panicked" -A1 "$OUT/seed-$seed.txt"
  done
} 2>&1 | tee "$OUT/seeds.txt"
device_tests
{
  pass=0 fail=0 i=0
  while [ $SECONDS -lt 480 ]; do
    i=$((i + 1))
    if .device/layer_ops dense_ops_match_the_cpu > "$OUT/dense.txt" 2>&1; then
      pass=$((pass + 1))
    else
      fail=$((fail + 1))
      cp "$OUT/dense.txt" "$OUT/dense-failed-$i.txt"
      grep -E "SEED|panicked" -A1 "$OUT/dense.txt"
    fi
  done
  rm -f "$OUT/dense.txt"
  log "$pass passed, $fail failed"
} 2>&1 | tee "$OUT/loop.txt"
