#!/usr/bin/env bash
# Call 10: sampling-check.sh on the session's last code (e278f99: the CPU backend's one-row
# products cut by columns, which the check's GPU-against-CPU parts read).
set -uo pipefail
source launch/device/env.sh
DEADLINE=150 OUT=$OUT bash launch/device/sampling-check.sh > /dev/null 2>&1
grep -E "test result|panicked|ALL PASS|FAIL|^== " "$OUT/check.txt"
