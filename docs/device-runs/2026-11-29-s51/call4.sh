#!/usr/bin/env bash
# Session 51, call 4 (one H200): decode_partial_mma's CTAs taking descriptors past the first
# wave from a queue, the next one-warp-per-head piece's first tile in flight before the current
# piece ends (`queue`, the working tree), against `base` (230858c). Correctness first (kernel
# compile, device tests, the conformance suite at 1 and 3 waves), then the attention alone
# (`bench kernel`, Llama shape, batch 1) and inside the 8B step (attention-in-step.sh) at 1-3
# waves.
set -uo pipefail
source launch/device/env.sh
export OUT
Q=.device/canopy B=.device/base
$Q compile-kernels 2>&1 | tail -1 | tee "$OUT/compile.txt"
device_tests > /dev/null 2>&1
grep -E "test result|FAIL|panicked" "$OUT/tests.txt"
for w in 1 3; do
  CANOPY_WAVES=$w timeout 150 $Q selftest --backend cuda --ranks 1 --cases 1 --kernel mma > /tmp/st.txt 2>&1
  echo "selftest waves $w rc $?: $(grep -E "passed|failed" /tmp/st.txt | tail -1)" | tee -a "$OUT/selftest.txt"
  grep -E "FAIL" /tmp/st.txt | head -5 >> "$OUT/selftest.txt"
done
{
  for w in 1 2 3 4; do
    for bin in $B $Q; do
      echo "== $(basename $bin) waves $w"
      $bin bench kernel --heads 32 --kv-heads 8 --head-dim 128 --dtype bf16 --seq-lens 8192,32768,131072 \
        --waves $w --iters 30 2>&1 | tail -6
    done
  done
} 2>&1 | tee "$OUT/kernel.txt"
for w in 1 2 3; do
  for bin in $B $Q; do
    echo "== $(basename $bin) waves $w" >> "$OUT/in-step.txt"
    CANOPY_WAVES=$w CANOPY_BIN=$bin CONTEXTS="32K" DECODE=12 OUT=/tmp/ais bash launch/device/attention-in-step.sh > /dev/null 2>&1
    grep -vE "^==|CUPTI" /tmp/ais/attention-in-step.txt | tail -6 >> "$OUT/in-step.txt"
  done
done
cat "$OUT/in-step.txt"
