#!/usr/bin/env bash
# Session 50, call 7 (one H200): the session's build (HEAD, decode_partial_ws not kept; the
# conformance suite gains prompt-72): the kernels' compile, the conformance suite on one rank
# with contiguous and paged KV, and the device tests.
set -uo pipefail
source launch/device/env.sh
export OUT
$BIN compile-kernels 2>&1 | tail -1 | tee "$OUT/compile.txt"
timeout 300 $BIN selftest --backend cuda --ranks 1 --cases 1 --kernel mma > "$OUT/selftest-full.txt" 2>&1
echo "selftest rc $?" > "$OUT/selftest.txt"
grep -E "prompt-72|FAIL|passed|failed" "$OUT/selftest-full.txt" | tail -60 >> "$OUT/selftest.txt"
device_tests > /dev/null 2>&1
grep -E "test result|FAIL|panicked" "$OUT/tests.txt"
tail -2 "$OUT/selftest.txt"
