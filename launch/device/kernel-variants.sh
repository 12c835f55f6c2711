#!/usr/bin/env bash
# Kernel development: the same `bench decode` with each variant of the kernel sources, in one
# call. Every folder under $VARIANTS (default .device/variants) holds replacement source files
# (`layers.cu`, `common.cuh`, ...; an empty folder is the embedded sources) and is run with
# CANOPY_KERNEL_SOURCES pointing at it, ROUNDS times in turn so drift shows. ARCH, CONTEXTS
# and DECODE shape the run. Results: $OUT/variants.jsonl (one line per run) and log.txt.
set -uo pipefail
source "$(dirname "$0")/env.sh"
VARIANTS=${VARIANTS:-.device/variants}
DEADLINE=${DEADLINE:-520}
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  for round in $(seq "${ROUNDS:-2}"); do
    for dir in "$VARIANTS"/*/; do
      name=$(basename "$dir")
      [ $SECONDS -gt "$DEADLINE" ] && { echo "SKIPPED $name round $round (time)"; continue; }
      CANOPY_KERNEL_SOURCES=$dir $BIN bench decode --arch "${ARCH:-llama-3.1-8b}" --random-weights \
        --context-fill random --context "${CONTEXTS:-8K,32K}" --ranks 1 --strategy tree \
        --decode "${DECODE:-20}" --json 2> "$OUT/$name-$round.err" \
        | python3 -c 'import json,sys
r=json.load(sys.stdin); v,k=sys.argv[1],sys.argv[2]
for x in r["rows"]:
    print(json.dumps(dict(variant=v, round=int(k), context=x["context"], ms=x["decode_ms_per_token"], floor=x["floor_ms"])))' "$name" "$round" \
        | tee -a "$OUT/variants.jsonl" || echo "FAILED $name round $round"
    done
  done
} 2>&1 | tee "$OUT/log.txt"
