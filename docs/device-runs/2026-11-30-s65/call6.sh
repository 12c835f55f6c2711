#!/usr/bin/env bash
# Session 65, call 6 (the build of 0bd6edf): sampling-check.sh (the device tests, the tiny
# model served on the GPU against generate and against the CPU, generate --logprobs,
# model-check.sh, bench serve at three samplings).
source launch/device/env.sh
DEADLINE=540 bash launch/device/sampling-check.sh > /dev/null 2>&1
grep -vE "^test .* ok$" "$OUT/check.txt" | tail -40
