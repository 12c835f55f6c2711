#!/usr/bin/env bash
# Session 53, call 4 (one H200): generate's start on the 8B-shaped files of load-times.sh with
# a cold page cache, beside a warm run; the build of 2455527. Also where /tmp lies.
set -uo pipefail
source launch/device/env.sh
export OUT
df -h /tmp | tee "$OUT/disk.txt"
mount | grep -E " / | /tmp " | tee -a "$OUT/disk.txt"
RUNS=1 OUT=/tmp/lt-warm bash launch/device/load-times.sh > /dev/null 2>&1
cp /tmp/lt-warm/load-times.txt "$OUT/load-times-warm.txt"
COLD=1 RUNS=2 OUT=/tmp/lt-cold bash launch/device/load-times.sh > /dev/null 2>&1
cp /tmp/lt-cold/load-times.txt "$OUT/load-times-cold.txt"
cat "$OUT/load-times-warm.txt" "$OUT/load-times-cold.txt"
