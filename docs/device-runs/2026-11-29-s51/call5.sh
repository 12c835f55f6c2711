#!/usr/bin/env bash
# Session 51, call 5 (one H200): call 4's queue with the next descriptor taken as a piece
# starts and published two tiles before its end (no barrier waits on the atomic), the queue's
# slots in dynamic shared memory (the warpgroup path keeps its 1024-byte alignment) and no fence
# at the CTA's exit. Correctness (the conformance suite at 1 and 3 waves, its last cases logged),
# then `bench kernel` and the attention inside the 8B step, against `base` (230858c).
set -uo pipefail
source launch/device/env.sh
export OUT
Q=.device/canopy B=.device/base
$Q compile-kernels 2>&1 | tail -1 | tee "$OUT/compile.txt"
device_tests > /dev/null 2>&1
grep -E "test result|FAIL|panicked" "$OUT/tests.txt"
for w in 1 3; do
  CANOPY_WAVES=$w RUST_LOG=debug timeout 200 $Q selftest --backend cuda --ranks 1 --cases 1 --kernel mma > /tmp/st.txt 2>&1
  echo "selftest waves $w rc $?: $(grep -E "passed|failed|error" /tmp/st.txt | tail -1)" | tee -a "$OUT/selftest.txt"
  grep -E "FAIL|fail " /tmp/st.txt | head -5 >> "$OUT/selftest.txt"
  grep -E "pass |error" /tmp/st.txt | tail -3 | cut -c1-250 >> "$OUT/selftest.txt"
done
cat "$OUT/selftest.txt"
{
  for w in 1 2 3; do
    for bin in $B $Q; do
      [ "$bin" = "$B" ] && [ $w -gt 2 ] && continue
      echo "== $(basename $bin) waves $w"
      $bin bench kernel --heads 32 --kv-heads 8 --head-dim 128 --dtype bf16 --seq-lens 8192,32768,131072 \
        --waves $w --iters 30 2>&1 | tail -3
    done
  done
} 2>&1 | tee "$OUT/kernel.txt"
for run in "$B 1" "$Q 1" "$Q 2" "$B 1"; do
  set -- $run
  echo "== $(basename $1) waves $2" >> "$OUT/in-step.txt"
  CANOPY_WAVES=$2 CANOPY_BIN=$1 CONTEXTS="8K 32K" DECODE=12 OUT=/tmp/ais bash launch/device/attention-in-step.sh > /dev/null 2>&1
  grep -E "^step|kernel" /tmp/ais/attention-in-step.txt >> "$OUT/in-step.txt"
done
cat "$OUT/in-step.txt"
