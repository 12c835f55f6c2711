#!/usr/bin/env bash
# Session 47, call 8 (one H200): call 7's build under compute-sanitizer: memcheck and racecheck
# on 12 samples (the GEMV's `_rows16` build), memcheck on a 20-token prompt (cuBLAS).
set -uo pipefail
source launch/device/env.sh
SAN=/usr/local/cuda-13.0/bin/compute-sanitizer
FIX=tests/fixtures/tiny
for tool in memcheck racecheck; do
  $SAN --tool $tool --error-exitcode 9 --print-limit 20 $BIN generate --backend cuda --prompt-ids 1,5,9,13,2,7,11 \
    --max-tokens 8 --temperature 0 --model $FIX/gqa-hd64 --dtype bf16 --n 12 --json > $OUT/san-n12-$tool.txt 2>&1
  echo "n12 $tool exit $?"; grep -E "ERROR SUMMARY|error" $OUT/san-n12-$tool.txt | head -3
done
$SAN --tool memcheck --error-exitcode 9 --print-limit 20 $BIN generate --backend cuda \
  --prompt-ids 1,5,9,13,2,7,11,3,17,4,23,6,19,8,29,10,31,12,37,14 --max-tokens 8 --temperature 0 \
  --model $FIX/llama3-hd128 --dtype bf16 > $OUT/san-prompt20.txt 2>&1
echo "prompt20 memcheck exit $?"; grep -E "ERROR SUMMARY" $OUT/san-prompt20.txt | head -2
