#!/usr/bin/env bash
# Session 51, call 8 (one H200): the session's build: the kernels' compile, the device tests, the
# conformance suite on one rank (contiguous and paged KV), and the K-quant GGUF fixture
# (tests/fixtures/kquant) generated on the GPU against transformers' tokens and logits.
set -uo pipefail
source launch/device/env.sh
export OUT
$BIN compile-kernels 2>&1 | tail -1 | tee "$OUT/compile.txt"
device_tests > /dev/null 2>&1
grep -E "test result|FAIL|panicked" "$OUT/tests.txt"
timeout 300 $BIN selftest --backend cuda --ranks 1 --cases 1 --kernel mma > "$OUT/selftest-full.txt" 2>&1
echo "selftest rc $?: $(tail -1 "$OUT/selftest-full.txt")" | tee "$OUT/selftest.txt"
python3 docs/device-runs/2026-11-29-s51/check_kquant.py 2>&1 | tee "$OUT/kquant.txt"
