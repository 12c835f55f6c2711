#!/usr/bin/env bash
# The random context fill (`--context-fill random`) drawn on the GPU: the fill and NCCL-pricing
# tests (.device/kv_fill, .device/layer_ops), then `bench decode` of the Llama-3.1-8B shape at
# CONTEXTS on RANKS ranks of this GPU with this build and with .device/canopy-base (the host
# draw), so the fill times and the decode steps (the same context, so the same speed) sit side
# by side. Results: $OUT/log.txt and $OUT/NAME.json.
set -uo pipefail
source "$(dirname "$0")/env.sh"
{
  log "tests"
  .device/kv_fill --nocapture 2>&1 | grep -E "^test |test result|equal|panicked"
  .device/layer_ops --test-threads 1 bad_operands 2>&1 | grep -E "^test |test result|panicked"
  for entry in new=$BIN base=.device/canopy-base; do
    name=${entry%%=*} bin=${entry#*=}
    log "$name: bench decode, random fill, ${CONTEXTS:=128K,480K} at ranks ${RANKS:=1,2}"
    $bin bench decode --arch llama-3.1-8b --random-weights --context-fill random \
      --context "$CONTEXTS" --ranks "$RANKS" --strategy tree --decode 10 --json > "$OUT/$name.json" \
      2> "$OUT/$name.err" || { echo "FAILED"; tail -3 "$OUT/$name.err"; }
    python3 -c 'import json,sys
r=json.load(open(sys.argv[1]))
for c in r["capacity"]: print(f"  longest at {c["ranks"]} rank(s): {c["longest_context"]}")
for x in r["rows"]: print(f"  {x["context"]:>7} P={x["ranks"]}: fill {x["fill_s"]:.2f} s, decode {x["decode_ms_per_token"]:.2f} ms/token")' "$OUT/$name.json"
  done
} 2>&1 | tee "$OUT/log.txt"
