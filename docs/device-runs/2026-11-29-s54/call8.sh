#!/usr/bin/env bash
# Session 54, call 8 (one H200): the build of the session's last code (20063a2 and the
# benchmark notes after it) checked: the device tests, then model-check.sh against
# transformers (fixtures, a tiny device model and the 8B shape at 4 layers, 1-4 ranks, tree
# and ring), whose weights are now read from their files and decoded by the reading threads.
set -uo pipefail
source launch/device/env.sh
export OUT
device_tests > /dev/null
grep -E "test result|panicked" "$OUT/tests.txt"
DEADLINE=110 OUT=/tmp/mc bash launch/device/model-check.sh > /tmp/mc-log.txt 2>&1
tail -4 /tmp/mc-log.txt | tee "$OUT/model-check-tail.txt"
cp /tmp/mc/model-check.txt "$OUT/" 2>/dev/null
grep -A5 "== summary" /tmp/mc/model-check.txt
