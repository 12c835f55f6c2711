#!/usr/bin/env bash
# Session 48, call 3 (one H200), build of a303272 + gemv-bench's slices (9-16 rows back on
# cuBLAS; GEMV_MAX_ROWS = 8): the kernels' compile and the device tests; then 2-8 rows on the
# GEMV (max8, this build) against cuBLAS (max1: GEMV_MAX_ROWS = NORMED_GEMV_ROWS = 1):
# batch-timeline.sh at N = 2, 4, 8 (traced passes) and untraced `generate --n N` of 96 tokens;
# then lt-bench and gemv-bench at 1, 2, 4 and 8 rows.
set -uo pipefail
source launch/device/env.sh
export OUT
$BIN compile-kernels 2>&1 | tail -1
device_tests > /dev/null
grep -E "test result|FAIL|panicked|bit for bit: false" $OUT/tests.txt | head -20
mkdir -p /tmp/b-max8 /tmp/b-max1; cp .device/canopy /tmp/b-max8/canopy; cp .device/canopy-max1 /tmp/b-max1/canopy
for n in 2 4 8; do
  for side in max8 max1; do
    mkdir -p $OUT/tl-$side-$n
    CANOPY_BIN=/tmp/b-$side/canopy CANOPY_KERNEL_CACHE=/tmp/kc-$side N=$n OUT=$OUT/tl-$side-$n timeout 75 bash launch/device/batch-timeline.sh > /dev/null 2>&1
    echo "== $side n=$n"; sed -n 4,5p $OUT/tl-$side-$n/batch-steps.txt; grep -A12 "GPU time by name" $OUT/tl-$side-$n/batch-steps.txt | tail -12
  done
done
for n in 2 4 8; do
  for side in max8 max1; do
    echo "== untraced $side n=$n: $(CANOPY_KERNEL_CACHE=/tmp/kc-$side timeout 60 /tmp/b-$side/canopy generate --arch llama-3.1-8b --random-weights --context-fill random --context 4K --n $n --max-tokens 96 2>&1 >/dev/null | grep -o 'decode [0-9.]* ms/token')"
  done
done
ITERS=100 ROWS=1,2,4,8 bash launch/device/lt-bench.sh 2>&1 | tail -18
ROWS="1 2 4 8" ROUNDS=1 bash launch/device/gemv-bench.sh 2>&1 | grep -E "^(qkv|o |gate|down|layer)"
cd $OUT && tar czf all.tgz tests.txt tl-* && rm -rf tl-*
