#!/usr/bin/env bash
# Session 48, call 8 (one H200): replayed passes of `generate --n 8` on the 8B shape, the
# build of 99da66f (new) against max1 (cuBLAS from 2 rows), two rounds in turn.
set -uo pipefail
source launch/device/env.sh
mkdir -p /tmp/b-max1; cp .device/canopy-max1 /tmp/b-max1/canopy
for round in 1 2; do
  for side in new max1; do
    bin=$BIN; [ $side = max1 ] && bin=/tmp/b-max1/canopy
    RUST_LOG=canopy_runtime=debug CANOPY_KERNEL_CACHE=/tmp/kc-$side timeout 60 $bin generate --arch llama-3.1-8b \
      --random-weights --context-fill random --context 4K --n 8 --max-tokens 64 > /dev/null 2> $OUT/log-$side-$round.txt
    echo "== round $round $side: $(python3 launch/device/tools/steps.py $OUT/log-$side-$round.txt | grep '^replayed')"
  done
done
cd $OUT && tar czf logs.tgz log-* && rm -f log-*
