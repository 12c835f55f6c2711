#!/usr/bin/env bash
# Issue 23: compute-sanitizer on short generations with the committed tiny models (no host
# round trips hidden from it: every kernel of prefill and decode, the GEMVs, the programmatic
# dependent launches, the tree and ring merges of ranks sharing the GPU). Each run is
# `canopy generate --backend cuda` of 8 tokens under each TOOLS entry (default memcheck, then
# racecheck and initcheck on one rank); a run passes when the sanitizer reports no error. One
# memcheck run prompts 16 tokens, more than the GEMV takes, so the prefill's products run on
# cuBLAS and read the rounded operands their producers write. (initcheck on that run reports
# `swiglu`'s reads of cuBLAS's output as uninitialized, on the session-22 build as well:
# BENCHMARKS, session 23.) One memcheck run decodes two samples of 48 tokens (TOKENS), past
# the 32 tokens of growth room: its replans rewrite the recorded step's plan in place, and
# its replays read the rewritten plan. Two memcheck runs prompt 100 tokens, whose products run
# at 128 rows (the padding rows of `product_rows`), and one of them again on 2 ranks in two
# pieces.
# Results: $OUT/sanitizer-*.txt and the summary in $OUT/sanitizer.txt.
set -uo pipefail
source "$(dirname "$0")/env.sh"
SAN=${SAN:-/usr/local/cuda-13.0/bin/compute-sanitizer}
FIX=tests/fixtures/tiny
runs=0 bad=0
check() { # name tool args...
  local name=$1 tool=$2
  shift 2
  "$SAN" --tool "$tool" --error-exitcode 9 --print-limit 20 "$BIN" generate --backend cuda \
    --prompt-ids "${PROMPT_IDS:-1,5,9,13,2,7,11}" --max-tokens "${TOKENS:-8}" --temperature 0 "$@" \
    > "$OUT/sanitizer-$name.txt" 2>&1
  local rc=$?
  runs=$((runs + 1))
  if [ $rc -eq 0 ]; then echo "PASS $name ($tool)"; else bad=$((bad + 1)); echo "FAIL $name ($tool, exit $rc)"; tail -15 "$OUT/sanitizer-$name.txt"; fi
}
{
  "$SAN" --version | head -2
  TOKENS=48 check llama3-hd128-bf16-r1-replan memcheck --model "$FIX/llama3-hd128" --dtype bf16 --n 2 --json
  for model in gqa-hd64 llama3-hd128 tied-mha-hd64; do
    check "$model-bf16-r1" memcheck --model "$FIX/$model" --dtype bf16
  done
  check gqa-hd64-f32-r1 memcheck --model "$FIX/gqa-hd64" --dtype f32
  check gqa-hd64-bf16-r2-tree memcheck --model "$FIX/gqa-hd64" --dtype bf16 --ranks 2 --strategy tree
  check gqa-hd64-bf16-r2-ring memcheck --model "$FIX/gqa-hd64" --dtype bf16 --ranks 2 --strategy ring
  for tool in ${TOOLS:-racecheck initcheck}; do
    check "llama3-hd128-bf16-r1-$tool" "$tool" --model "$FIX/llama3-hd128" --dtype bf16
  done
  PROMPT_IDS=1,5,9,13,2,7,11,3,17,4,23,6,19,8,29,10 \
    check llama3-hd128-bf16-r1-prompt16 memcheck --model "$FIX/llama3-hd128" --dtype bf16
  # 100 prompt rows: the products run at 128, their padding rows in every activation.
  long=$(seq -s, 3 3 300)
  for dtype in bf16 f32; do
    PROMPT_IDS=$long check "gqa-hd64-$dtype-r1-prompt100" memcheck --model "$FIX/gqa-hd64" --dtype $dtype
  done
  # The same on 2 ranks in pieces of 64: the first piece's keys and values gathered, the
  # second's queries.
  PROMPT_IDS=$long check gqa-hd64-bf16-r2-prompt100-pieces memcheck --model "$FIX/gqa-hd64" \
    --dtype bf16 --ranks 2 --prefill-chunk 32
  echo "$((runs - bad))/$runs runs clean"
} 2>&1 | tee "$OUT/sanitizer.txt"
