#!/usr/bin/env bash
# Call 1: sampling-check.sh on the session's last code (ffed2e9: the CPU's blocked attention with
# vectorized exponentials, fused 8-wide loops and AVX2 scores; the GPU's code is as session
# 73's). The device tests and the request-field and logprob checks hold the GPU to the CPU,
# whose attention changed.
set -uo pipefail
source launch/device/env.sh
DEADLINE=330 OUT=$OUT bash launch/device/sampling-check.sh > /dev/null 2>&1
grep -E "test result|panicked|ALL PASS|FAIL|^== |completed" "$OUT/check.txt"
