#!/usr/bin/env bash
# Call 6: compute-sanitizer (sanitizer.sh: memcheck, racecheck, initcheck on the tiny models)
# on the build of 868ea17, whose RoPE kernels take their items from one flat range.
set -uo pipefail
source launch/device/env.sh
bash launch/device/sanitizer.sh > /dev/null 2>&1
cat "$OUT/sanitizer.txt"
