#!/usr/bin/env bash
# The output projection's weight brought into L2 by the merge's CTAs while they wait for the
# attention (CANOPY_PREFETCH_BYTES of it at each of BUDGETS; 0: none): `bench decode` of the
# Llama-3.1-8B shape (random weights and context, one rank, tree, DECODE tokens) at CONTEXTS,
# ROUNDS rounds. Results: $OUT/prefetch-decode.jsonl.
set -uo pipefail
source "$(dirname "$0")/env.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
$BIN compile-kernels > /dev/null 2>&1 || echo "compile-kernels FAILED"
for round in $(seq "${ROUNDS:-2}"); do
  for b in ${BUDGETS:-0 8388608 16777216 33554432}; do
    CANOPY_PREFETCH_BYTES=$b $BIN bench decode --arch llama-3.1-8b --random-weights --context-fill random \
      --context "${CONTEXTS:-8K,32K}" --ranks 1 --strategy tree --decode "${DECODE:-40}" --json 2>/dev/null |
      python3 -c 'import json, sys; d = json.load(sys.stdin)
for r in d["rows"]: print(json.dumps({"round": '"$round"', "budget": '"$b"', "context": r["context"], "median_ms": round(r["decode_ms_per_token"], 4), "mean_ms": round(r["decode_mean_ms_per_token"], 4), "vs_floor": round(r["vs_floor"], 4)}))' |
      tee -a "$OUT/prefetch-decode.jsonl"
  done
done
