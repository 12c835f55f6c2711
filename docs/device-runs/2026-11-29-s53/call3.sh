#!/usr/bin/env bash
# Session 53, call 3 (one H200): the build of 2455527 (session 52's last: weights read as each
# upload asks, staged through page-locked memory), checked against transformers and under
# compute-sanitizer: model-check.sh (fixtures, a tiny device model and the 8B shape at 4
# layers, 1-4 ranks, tree and ring), then sanitizer.sh (memcheck, racecheck, initcheck).
set -uo pipefail
source launch/device/env.sh
export OUT
DEADLINE=330 OUT=/tmp/mc bash launch/device/model-check.sh > /tmp/mc-log.txt 2>&1
tail -4 /tmp/mc-log.txt | tee "$OUT/model-check-tail.txt"
cp /tmp/mc/model-check.txt /tmp/mc/model-check.json "$OUT/" 2>/dev/null
tar czf "$OUT/model-check-log.tgz" -C /tmp mc-log.txt mc/canopy-stderr.log mc/reference.log 2>/dev/null
OUT=/tmp/san bash launch/device/sanitizer.sh > /dev/null 2>&1
cat /tmp/san/sanitizer.txt | tee "$OUT/sanitizer.txt"
tar czf "$OUT/sanitizer-runs.tgz" -C /tmp san
