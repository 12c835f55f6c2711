#!/usr/bin/env bash
# Session 45, call 2 (one H200): model-check.sh's default stages on e0667e4's build.
set -uo pipefail
mkdir -p $OUT/r
DEADLINE=540 OUT=$OUT/r bash launch/device/model-check.sh > /dev/null 2>&1
echo "exit $?"
tail -3 $OUT/r/model-check-log.txt
cd $OUT && tar czf all.tgz r && rm -rf r
