#!/usr/bin/env bash
# Call 2: sampling-check.sh on the session's last code (316f86a: a quantized weight in panels
# on the CPU; the f32 products the check's GPU-against-CPU parts read are as session 72's).
set -uo pipefail
source launch/device/env.sh
DEADLINE=150 OUT=$OUT bash launch/device/sampling-check.sh > /dev/null 2>&1
grep -E "test result|panicked|ALL PASS|FAIL|^== |completed" "$OUT/check.txt"
