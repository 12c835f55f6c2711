#!/usr/bin/env bash
# Session 47, call 2 (one H200): batch-timeline.sh with and without the L2 prefetch of the
# output projection's weight (the build of call 1).
set -uo pipefail
for v in off 64,64,132,9; do
  if [ $v = off ]; then unset CANOPY_L2_PREFETCH; else export CANOPY_L2_PREFETCH=$v; fi
  mkdir -p $OUT/$v
  OUT=$OUT/$v timeout 250 bash launch/device/batch-timeline.sh > /dev/null 2>&1
  echo "== $v exit $?"; grep -A16 "GPU time by name" $OUT/$v/batch-steps.txt
done
cd $OUT && tar czf all.tgz off 64* && rm -rf off 64,64,132,9
