#!/usr/bin/env bash
# Call 1: sampling-check.sh on the session's last code (124acb4: a CPU rank's own rayon pool, and
# the CPU's coded products with a group's step and offset applied once; the GPU's code is as
# session 73's).
set -uo pipefail
source launch/device/env.sh
DEADLINE=150 OUT=$OUT bash launch/device/sampling-check.sh > /dev/null 2>&1
grep -E "test result|panicked|ALL PASS|FAIL|^== |completed" "$OUT/check.txt"
