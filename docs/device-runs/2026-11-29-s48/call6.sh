#!/usr/bin/env bash
# Session 48, call 6 (one H200): a working-tree build (GEMV_MAX_ROWS = 2 and the split rule of
# variants/balanced-slices.md) through the kernels' compile and the device tests; ab-decode
# against max8 (a303272: 8 rows, slices that fit one wave); then replayed passes of
# `generate --n 4|8` on the small shapes (SmolLM2-135M, Llama-3.2-1B), GEMV at 2-8 rows (max8)
# against cuBLAS (max1).
set -uo pipefail
source launch/device/env.sh
export OUT
$BIN compile-kernels 2>&1 | tail -1
device_tests > /dev/null
grep -E "test result|FAIL|panicked|bit for bit: false" $OUT/tests.txt | head -20
BINS="new=$BIN base=.device/canopy-max8" ARCHS="llama-3.1-8b llama-3.2-1b" ROUNDS=2 DEADLINE=200 \
  bash launch/device/ab-decode.sh > /dev/null 2>&1
python3 -c '
import json
for l in open("'$OUT'/ab.jsonl"):
    r = json.loads(l); print(r["bin"], r["arch"], r["round"], r["context"], "%.3f" % r["ms"], "floor %.3f" % r["floor"])'
mkdir -p /tmp/b-max8 /tmp/b-max1; cp .device/canopy-max8 /tmp/b-max8/canopy; cp .device/canopy-max1 /tmp/b-max1/canopy
for arch in smollm2-135m llama-3.2-1b; do
  for n in 4 8; do
    for side in max8 max1; do
      RUST_LOG=canopy_runtime=debug CANOPY_KERNEL_CACHE=/tmp/kc-$side timeout 60 /tmp/b-$side/canopy generate --arch $arch \
        --random-weights --context-fill random --context 4K --n $n --max-tokens 64 > /dev/null 2> $OUT/log-$arch-$side-$n.txt
      echo "== $arch $side n=$n: $(python3 launch/device/tools/steps.py $OUT/log-$arch-$side-$n.txt | grep '^replayed')"
    done
  done
done
cd $OUT && tar czf logs.tgz log-* tests.txt && rm -f log-*
