#!/usr/bin/env bash
# Session 46, call 7 (one H200), build of 8235c0f: sanitizer.sh (issue 23's compute-sanitizer
# runs on short generations) on the build with the lazy rescale.
set -uo pipefail
mkdir -p $OUT/r
OUT=$OUT/r timeout 420 bash launch/device/sanitizer.sh > /dev/null 2>&1
echo "exit $?"; cat $OUT/r/sanitizer.txt
cd $OUT && tar czf all.tgz r && rm -rf r
