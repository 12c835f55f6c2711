#!/usr/bin/env bash
# GEMM operands rounded by the ops that write them (no rounding kernel before a 16-bit cuBLAS
# GEMM), this build (.device/canopy) against BASE (default .device/canopy-base): the layer-op
# tests and the graph test, then for each binary the batched decode step's phases
# (profile-batch.sh at NS, default "16 64") and a 32K prefill (`bench decode`, random weights,
# one rank). Results: $OUT/tests.txt, $OUT/<bin>/steps.txt, $OUT/prefill.jsonl, log.txt.
set -uo pipefail
source "$(dirname "$0")/env.sh"
BASE=${BASE:-.device/canopy-base}
{
  device_tests
  for round in 1 2; do
    for entry in new=$BIN base=$BASE; do
      name=${entry%%=*} bin=${entry#*=}
      log "$name round $round: batched steps"
      CANOPY_BIN=$bin NS="${NS:-16 64}" OUT=$OUT/$name-$round bash "$(dirname "$0")/profile-batch.sh" > /dev/null
      cat "$OUT/$name-$round/steps.txt"
      log "$name round $round: 32K prefill"
      $bin bench decode --arch llama-3.1-8b --random-weights --context 32K --ranks 1 --strategy tree \
        --decode 3 --json 2> "$OUT/$name-prefill-$round.err" | python3 -c 'import json,sys
r=json.load(sys.stdin)
for x in r["rows"]:
    print(json.dumps(dict(bin=sys.argv[1], round=int(sys.argv[2]), context=x["context"], fill_s=x["fill_s"], tflops=x["prefill_tflops_per_device"], peak=x["peak_bytes"])))' "$name" "$round" \
        | tee -a "$OUT/prefill.jsonl"
    done
  done
} 2>&1 | tee "$OUT/log.txt"
