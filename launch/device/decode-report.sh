#!/usr/bin/env bash
# Issue 23's report of `bench decode` on one GPU, Llama-3.1-8B's shape with random weights:
# 1. the paper's Table 1 at 8K and 32K, prefilled, tree and ring at 1 and 2 ranks (prefill
#    tokens/s and TFLOP/s beside the GEMM rate, TTFT, ms/token against the floor, merge per
#    layer, peak memory), with its CSV and plot;
# 2. the longest context the GPU holds with a random fill (the capacity a short run reports),
#    decoded, then one token longer, which must be refused with the numbers;
# 3. the tree's merge per layer at 1, 2 and 4 ranks sharing the GPU, at 32K.
# Results under $OUT: decode-*.json, decode-table1.csv, decode-table1.svg, decode-report.txt.
# CONTEXTS narrows section 1; LIMIT caps each run (seconds).
set -uo pipefail
source "$(dirname "$0")/env.sh"
LIMIT=${LIMIT:-240}
ARCH=(--arch llama-3.1-8b --random-weights)
bench() { timeout "$LIMIT" $BIN bench decode "${ARCH[@]}" "$@"; }
PLOT=(--plot "$OUT/decode-table1.svg")
[ -f "$CANOPY_FONT" ] || { echo "no TrueType font: no plot"; PLOT=(); }
{
  nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
  echo "== 1. Table 1, prefilled"
  bench --context "${CONTEXTS:-8K,32K}" --ranks 1,2 --strategy tree,ring --decode 10 \
    --csv "$OUT/decode-table1.csv" "${PLOT[@]}" \
    || echo "FAILED or cut off: Table 1"
  echo "== 2. the longest context, random fill"
  bench --context 8K --context-fill random --ranks 1 --decode 2 --json \
    > "$OUT/decode-capacity.json" || echo "FAILED: capacity"
  longest=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["capacity"][0]["longest_context"])' \
    "$OUT/decode-capacity.json")
  echo "capacity at 1 rank: $longest tokens"
  bench --context "$longest" --context-fill random --ranks 1 --strategy tree --decode 5 \
    || echo "FAILED or cut off: the longest context"
  echo "-- one token more (must be refused with the numbers):"
  bench --context "$((longest + 1))" --context-fill random --ranks 1 --decode 5 \
    && echo "NOT REFUSED: $((longest + 1)) tokens"
  echo "== 3. the merge per layer, ranks sharing the GPU"
  bench --context 32K --context-fill random --ranks 1,2,4 --strategy tree --decode 10 --json \
    > "$OUT/decode-merge.json" || echo "FAILED or cut off: merge"
  python3 - "$OUT/decode-merge.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for x in r["rows"]:
    print(x["ranks"], x["strategy"], "ms/token", x["decode_ms_per_token"],
          "merge ms/layer", x["merge_ms_per_layer"], "peak GiB", (x["peak_bytes"] or 0) / 2**30)
PY
} 2>&1 | tee "$OUT/decode-report.txt"
