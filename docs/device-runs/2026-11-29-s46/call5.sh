#!/usr/bin/env bash
# Session 46, call 5 (one H200): serve.sh (issue 24) build of 8235c0f: the lazy rescale and the
# decode path's stepped descriptors.
set -uo pipefail
mkdir -p $OUT/r
DEADLINE=400 OUT=$OUT/r bash launch/device/serve.sh > /dev/null 2>&1
echo "exit $?"; tail -40 $OUT/r/serve-log.txt
cd $OUT && tar czf all.tgz r && rm -rf r
