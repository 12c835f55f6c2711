#!/usr/bin/env bash
# Session 45, call 8 (one H200), build of 7f7c104: serve.sh (issue 24) on one H200.
set -uo pipefail
mkdir -p $OUT/r
DEADLINE=420 OUT=$OUT/r bash launch/device/serve.sh > /dev/null 2>&1
echo "exit $?"; tail -40 $OUT/r/serve-log.txt
cd $OUT && tar czf all.tgz r && rm -rf r
