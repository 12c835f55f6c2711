#!/usr/bin/env bash
# Session 46, call 4 (one H200), build of 8235c0f: model-check.sh (fixtures, tiny and
# 8B-shaped models against transformers, P ranks against one), the device tests, and the
# conformance suite on 1 and 2 ranks.
set -uo pipefail
source launch/device/env.sh
mkdir -p $OUT/r
DEADLINE=200 OUT=$OUT/r bash launch/device/model-check.sh > /dev/null 2>&1
echo "model-check exit $?"
tail -3 $OUT/r/model-check-log.txt
OUT=$OUT/r device_tests > /dev/null
grep -E "test result|FAIL|panicked" $OUT/r/tests.txt
timeout $((570 - SECONDS)) $BIN selftest --backend cuda --ranks 1,2 --cases 1 --kernel mma > $OUT/r/selftest.txt 2>&1
echo "selftest exit $? at ${SECONDS}s"; tail -3 $OUT/r/selftest.txt
cd $OUT && tar czf all.tgz r && rm -rf r
