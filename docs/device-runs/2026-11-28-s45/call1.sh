#!/usr/bin/env bash
# Session 45, call 1 (one H200): the copy-engine ring's checks with 4 ranks on one GPU.
set -uo pipefail
mkdir -p $OUT/r
G=4 PART="test check" CHECK_CASES="f32:2:ring f32:4:ring bf16:4:ring" FIXTURE_LIMIT=480 \
  DEADLINE=575 OUT=$OUT/r bash launch/device/peer-ring.sh > /dev/null 2>&1
cp /tmp/canopy-model-check/plan-fixtures.tsv $OUT/r/ 2>/dev/null
cd $OUT && tar czf all.tgz r && rm -rf r
