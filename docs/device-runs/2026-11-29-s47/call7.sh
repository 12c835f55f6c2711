#!/usr/bin/env bash
# Session 47, call 7 (one H200): the GEMV for up to 16 rows (its `_rows16` build; the build of
# 7c4ed20's code but for two comments) against d21c590's (canopy-base: 9-16 rows on cuBLAS):
# the kernels' compile, the device tests, batch-1 decode at 8K (the build for up to 8 rows must
# not move), then `generate --n 12` and `--n 16` over a random 4K prompt (8B shape, random
# weights), alternating, two rounds.
set -uo pipefail
source launch/device/env.sh
export OUT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
$BIN compile-kernels 2>&1 | tail -2 | tee "$OUT/compile.txt"
device_tests > /dev/null
grep -E "test result|FAIL|panicked|bit for bit: false" $OUT/tests.txt | head -20
ms() { python3 -c 'import json,sys
r=json.load(open(sys.argv[1]))
for x in r["rows"]: print(sys.argv[2], x["context"], "decode_ms %.3f" % x["decode_ms_per_token"], "floor %.3f" % x["floor_ms"])' "$1" "$2"; }
for round in 1 2; do
  for side in base new; do
    bin=$BIN; [ $side = base ] && bin=.device/canopy-base
    CANOPY_KERNEL_CACHE=/tmp/kc-$side $bin bench decode --arch llama-3.1-8b --random-weights --context-fill random \
      --context 8K --ranks 1 --strategy tree --decode 30 --json > "$OUT/d-$side-$round.json" 2> "$OUT/d-$side-$round.err"
    ms "$OUT/d-$side-$round.json" "batch1 $side r$round" | tee -a "$OUT/perf.txt"
  done
done
for round in 1 2; do
  for n in 12 16; do
    for side in base new; do
      bin=$BIN; [ $side = base ] && bin=.device/canopy-base
      line=$(CANOPY_KERNEL_CACHE=/tmp/kc-$side $bin generate --arch llama-3.1-8b --random-weights --context-fill random \
        --context 4K --n $n --max-tokens 40 2>&1 >/dev/null | grep -E "ms/token|rror" | tail -1)
      echo "n=$n $side r$round: $line" | tee -a "$OUT/perf.txt"
    done
  done
done
cd $OUT && tar czf all.tgz *.txt *.json *.err 2>/dev/null && rm -f *.json *.err
