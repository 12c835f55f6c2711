#!/usr/bin/env bash
# Session 49, call 11 (one H200): the build of 4a65328 (the Rust code of the session's last
# commit): the kernels' compile, the device tests, a short batch-1 bench decode at 8K and 32K,
# and model-check.sh.
set -uo pipefail
source launch/device/env.sh
export OUT
$BIN compile-kernels 2>&1 | tail -1
device_tests > /dev/null
grep -E "test result|FAIL|panicked|bit for bit: false" $OUT/tests.txt | head -20
timeout 120 $BIN bench decode --arch llama-3.1-8b --random-weights --context-fill random --context 8K,32K \
  --ranks 1 --strategy tree --decode 20 2>&1 | tail -6
mkdir -p $OUT/mc
DEADLINE=300 OUT=$OUT/mc timeout 330 bash launch/device/model-check.sh > $OUT/mc/console.txt 2>&1
echo "model-check rc $?"; tail -4 $OUT/mc/console.txt
cd $OUT && tar czf all.tgz tests.txt mc && rm -rf mc
