#!/usr/bin/env bash
# Call 1: sampling-check.sh on session 72's last code (4f41fcf): the quantized decoders now go
# through codes, and the CPU backend that the check's GPU-against-CPU parts read keeps a
# quantized model's weights as codes.
set -uo pipefail
source launch/device/env.sh
DEADLINE=150 OUT=$OUT bash launch/device/sampling-check.sh > /dev/null 2>&1
grep -E "test result|panicked|ALL PASS|FAIL|^== |completed" "$OUT/check.txt"
