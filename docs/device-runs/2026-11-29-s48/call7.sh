#!/usr/bin/env bash
# Session 48, call 7 (one H200): the build of 99da66f (gemv_takes_rows: the GEMV keeps 1-2
# rows of any weight, up to 8 of a weight of at most 16 MiB): the kernels' compile and the
# device tests; replayed passes of `generate --n 4|8` on the three shapes; model-check.sh.
set -uo pipefail
source launch/device/env.sh
export OUT
$BIN compile-kernels 2>&1 | tail -1
device_tests > /dev/null
grep -E "test result|FAIL|panicked|bit for bit: false" $OUT/tests.txt | head -20
for arch in llama-3.1-8b llama-3.2-1b smollm2-135m; do
  for n in 4 8; do
    RUST_LOG=canopy_runtime=debug CANOPY_KERNEL_CACHE=/tmp/kc-new timeout 60 $BIN generate --arch $arch \
      --random-weights --context-fill random --context 4K --n $n --max-tokens 64 > /dev/null 2> $OUT/log-$arch-$n.txt
    echo "== $arch new n=$n: $(python3 launch/device/tools/steps.py $OUT/log-$arch-$n.txt | grep '^replayed')"
  done
done
mkdir -p $OUT/mc
DEADLINE=300 OUT=$OUT/mc timeout 330 bash launch/device/model-check.sh > $OUT/mc/console.txt 2>&1
echo "model-check rc $?"; tail -4 $OUT/mc/console.txt
cd $OUT && tar czf all.tgz log-* tests.txt mc && rm -rf log-* mc
