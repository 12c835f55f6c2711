#!/usr/bin/env bash
# Session 46, call 2 (one H200): the lazy rescale (variants/new) against the base mma.cuh
# (variants/base), as kernel-source variants of one binary, alternating: the 8B shape's prefill
# at 32K and 127K (one rank, random bf16 weights), then decode at 8K and 32K (random context,
# 20 tokens). (The decode lines' summary failed on the random fill's missing TFLOP/s; the JSON
# is in runs.tgz.)
set -uo pipefail
source launch/device/env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version,power.limit --format=csv,noheader | tee "$OUT/log.txt"
summ() { python3 -c 'import json,sys
r=json.load(open(sys.argv[1]))
for x in r["rows"]: print(sys.argv[2], x["context"], "fill_s %.4f" % x["fill_s"], "tflops %.0f" % x["prefill_tflops_per_device"], "decode_ms %.3f" % x["decode_ms_per_token"], "floor %.3f" % x["floor_ms"])' "$1" "$2"; }
for round in 1 2; do
  for side in base new; do
    [ $SECONDS -gt 430 ] && { echo "SKIPPED prefill $side $round" | tee -a "$OUT/log.txt"; continue; }
    CANOPY_KERNEL_SOURCES=.device/variants/$side CANOPY_KERNEL_CACHE=/tmp/kc-$side $BIN bench decode \
      --arch llama-3.1-8b --random-weights --context 32K,127K --ranks 1 --strategy tree --decode 3 --json \
      > "$OUT/prefill-$side-$round.json" 2> "$OUT/prefill-$side-$round.err"
    summ "$OUT/prefill-$side-$round.json" "prefill $side r$round" | tee -a "$OUT/log.txt"
  done
done
for round in 1 2; do
  for side in base new; do
    [ $SECONDS -gt 540 ] && { echo "SKIPPED decode $side $round" | tee -a "$OUT/log.txt"; continue; }
    CANOPY_KERNEL_SOURCES=.device/variants/$side CANOPY_KERNEL_CACHE=/tmp/kc-$side $BIN bench decode \
      --arch llama-3.1-8b --random-weights --context-fill random --context 8K,32K --ranks 1 --strategy tree \
      --decode 20 --json > "$OUT/decode-$side-$round.json" 2> "$OUT/decode-$side-$round.err"
    summ "$OUT/decode-$side-$round.json" "decode $side r$round" | tee -a "$OUT/log.txt"
  done
done
cd "$OUT" && tar czf all.tgz *.json *.err log.txt && rm -f *.json *.err
