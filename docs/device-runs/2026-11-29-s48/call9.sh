#!/usr/bin/env bash
# Session 48, call 9 (one H200): cuBLAS loaded with the first weight (the working tree on
# 99da66f): the device tests, then `generate --n 4` on the 8B shape (random weights, random 4K
# context, 32 tokens): its first decode steps from the debug log, beside call 7's (99da66f).
set -uo pipefail
source launch/device/env.sh
export OUT
$BIN compile-kernels 2>&1 | tail -1
device_tests > /dev/null
grep -E "test result|FAIL|panicked|bit for bit: false" $OUT/tests.txt | head -20
RUST_LOG=canopy_runtime=debug CANOPY_KERNEL_CACHE=/tmp/kc-new timeout 90 $BIN generate --arch llama-3.1-8b \
  --random-weights --context-fill random --context 4K --n 4 --max-tokens 32 > /dev/null 2> $OUT/log-n4.txt
grep -E "prompt tokens|loaded|load" $OUT/log-n4.txt | sed 's/\x1b\[[0-9;]*m//g' | head -5
python3 launch/device/tools/steps.py $OUT/log-n4.txt
python3 - $OUT/log-n4.txt <<'PY'
import re, sys
for i, l in enumerate(x for x in open(sys.argv[1]) if 'decode step' in x):
    if i < 4: print(re.sub(r'\x1b\[[0-9;]*m', '', l).strip()[-140:])
PY
cd $OUT && tar czf logs.tgz log-* tests.txt && rm -f log-*
