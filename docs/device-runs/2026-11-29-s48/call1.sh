#!/usr/bin/env bash
# Session 48, call 1 (one H200), build of feb8360: the kernels' compile and the device tests,
# model-check.sh (not run on the GEMV-16 build last session), then where a 16-row decode pass
# goes (batch-timeline.sh with N=16) with this build and with d21c590's (canopy-base: 9-16
# rows on cuBLAS).
set -uo pipefail
source launch/device/env.sh
export OUT
$BIN compile-kernels 2>&1 | tail -1
device_tests > /dev/null
grep -E "test result|FAIL|panicked|bit for bit: false" $OUT/tests.txt | head -20
mkdir -p $OUT/mc
DEADLINE=330 OUT=$OUT/mc timeout 360 bash launch/device/model-check.sh > $OUT/mc/console.txt 2>&1
echo "model-check rc $?"; tail -3 $OUT/mc/console.txt
for side in new base; do
  dir=.device; [ $side = base ] && { dir=/tmp/base-bin; mkdir -p $dir; cp .device/canopy-base $dir/canopy; }
  mkdir -p $OUT/tl-$side
  CANOPY_BIN=$dir/canopy CANOPY_KERNEL_CACHE=/tmp/kc-$side N=16 OUT=$OUT/tl-$side timeout 75 bash launch/device/batch-timeline.sh > /dev/null 2>&1
  echo "== $side"; sed -n 4,5p $OUT/tl-$side/batch-steps.txt; grep -A14 "GPU time by name" $OUT/tl-$side/batch-steps.txt
done
cd $OUT && tar czf all.tgz tests.txt mc tl-* && rm -rf tl-* mc
