#!/usr/bin/env bash
# The output projection's weight brought into L2 during a batched step's attention: `canopy
# generate --n N` (64) over a random CONTEXT-token prompt (4K), Llama-3.1-8B shape, random
# weights, TOKENS tokens, with CANOPY_PREFETCH_BYTES at each of BUDGETS (0: off), and the base
# binary, ROUNDS rounds alternating. Results: $OUT/prefetch-ab.jsonl (one report a run).
set -uo pipefail
source "$(dirname "$0")/env.sh"
BASE=${BASE_BIN:-.device/canopy-base}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for bin in "$BIN" "$BASE"; do $bin compile-kernels > /dev/null 2>&1 || echo "compile-kernels $bin FAILED"; done
run() {  # label, binary, budget
  local r
  r=$(CANOPY_PREFETCH_BYTES=$3 $2 generate --arch llama-3.1-8b --random-weights --context-fill random \
    --context "${CONTEXT:-4K}" --n "${N:-64}" --max-tokens "${TOKENS:-48}" --json 2>/dev/null |
    python3 -c 'import json,sys; d=json.load(sys.stdin); print(json.dumps({k: d.get(k) for k in ("decode_ms_per_token","replayed_steps")}))')
  echo "{\"label\": \"$1\", \"budget\": $3, \"report\": $r}" | tee -a "$OUT/prefetch-ab.jsonl"
}
for round in $(seq "${ROUNDS:-2}"); do
  log "round $round"
  run base "$BASE" 0
  for b in ${BUDGETS:-0 16777216 33554432}; do run new "$BIN" "$b"; done
done
