#!/usr/bin/env bash
# Session 46, call 6 (one H200), build of 8235c0f: where the batch-64 pass's GPU time goes on an
# H200 (batch-timeline.sh: generate --n 64 over a random 4K prompt, 8B shape, CUPTI trace).
set -uo pipefail
mkdir -p $OUT/r
OUT=$OUT/r timeout 400 bash launch/device/batch-timeline.sh > /dev/null 2>&1
echo "exit $?"; sed -n 1,6p $OUT/r/batch-steps.txt; grep -A22 "GPU time by name" $OUT/r/batch-steps.txt
cd $OUT && tar czf all.tgz r && rm -rf r
