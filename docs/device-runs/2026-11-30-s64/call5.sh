#!/usr/bin/env bash
# Session 64, call 5: call 4 again, `new` now the build whose rounding merges are entries of
# their own: few-shot at 40 requests a second twice (the binaries' order swapped) and all at
# once; multi-chain all at once with `auto` (both builds) and `q-guided` (`new`); `bench tree`
# (whose merges write no operand) on the served trees and FastTree's tree 4, base against new;
# the batch-64 pass traced on `new`; then the device tests.
set -uo pipefail
export TESTS=""
ab=launch/device/arrivals-ab.sh
BINS="new=.device/canopy base=.device/base" RATES="40" OUT=$OUT/r1 bash $ab > /dev/null 2>&1
BINS="base=.device/base new=.device/canopy" RATES="40 inf" OUT=$OUT/r2 bash $ab > /dev/null 2>&1
BINS="new=.device/canopy base=.device/base" DATASETS=multi-chain PROMPTS=128 RATES="inf" \
  OUT=$OUT/mc bash $ab > /dev/null 2>&1
BINS="new=.device/canopy" DATASETS=multi-chain METHODS=q-guided PROMPTS=128 RATES="inf" \
  OUT=$OUT/mcq bash $ab > /dev/null 2>&1
A_BIN=.device/base B_BIN=.device/canopy HEADS=8 METHODS=auto ROUNDS=3 \
  TREES="configs/workloads/serve-few-shot.toml configs/workloads/serve-multi-chain.toml 4" \
  OUT=$OUT/tree bash launch/device/ab-tree.sh > /dev/null 2>&1
for b in canopy; do
  CANOPY_BIN=.device/$b OUT=$OUT/bt-$b bash launch/device/batch-timeline.sh > /dev/null 2>&1
done
source launch/device/env.sh
device_tests > /dev/null
for d in r1 r2 mc mcq; do for f in "$OUT"/$d/rate-*.txt; do echo "# $d/$(basename "$f")"; cat "$f"; done; done
for b in canopy; do echo "# batch-timeline, $b"; cat "$OUT/bt-$b/batch-steps.txt"; done
cat "$OUT/tree/ab-log.txt" "$OUT/tests.txt"
cd "$OUT" && tar czf runs.tgz r1 r2 mc mcq tree bt-canopy && rm -rf r1 r2 mc mcq tree bt-*
