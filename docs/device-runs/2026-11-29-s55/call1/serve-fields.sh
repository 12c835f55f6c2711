#!/usr/bin/env bash
# The server's request fields that read whole logits rows on the GPU (log-probabilities,
# penalties, logit_bias) and several prompts per request:
# 1. the tiny fixture model (f32) served on the GPU and on the CPU answer the same requests
#    alike (serve_fields.py check);
# 2. the 8B shape with random weights (bf16) under CONCURRENCY streamed completions, timed
#    with none, one or all of them asking for log-probabilities, and all penalised
#    (serve_fields.py load).
# Run from the repository root on the device machine with the release binary in .device/.
# Results: $OUT/fields.txt, $OUT/load.jsonl and the servers' logs.
set -uo pipefail
source "$(dirname "$0")/env.sh"
DEADLINE=${DEADLINE:-480}
TINY=tests/fixtures/tiny/gqa-hd64
PY=launch/device/serve_fields.py

# start_server NAME ARGS...: `canopy serve` on a free port; sets SERVER (its pid) and URL.
start_server() {
  local name=$1
  shift
  $BIN serve --port 0 "$@" > "$OUT/server-$name.log" 2>&1 &
  SERVER=$!
  URL=
  while [ -z "$URL" ]; do
    kill -0 $SERVER 2>/dev/null || { log "server $name died:"; tail -5 "$OUT/server-$name.log"; return 1; }
    sleep 0.5
    URL=$(grep -o 'listening on http://[0-9.:]*' "$OUT/server-$name.log" | head -1 | cut -d' ' -f3)
  done
  log "server $name at $URL"
}
stop_server() { kill -TERM "$1" 2>/dev/null; wait "$1" 2>/dev/null; }

{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import json; print(json.dumps([p['token_ids'] for p in json.load(open('$TINY/reference.json'))['prompts']]))" > /tmp/prompts.json
  start_server gpu-tiny --model $TINY --backend cuda --dtype f32 && GPU_PID=$SERVER GPU_URL=$URL
  start_server cpu-tiny --model $TINY --backend cpu && CPU_PID=$SERVER CPU_URL=$URL
  log "check: the GPU against the CPU"
  python3 $PY check "$GPU_URL" "$CPU_URL" /tmp/prompts.json
  stop_server "$GPU_PID"
  stop_server "$CPU_PID"
} 2>&1 | tee "$OUT/fields.txt"

{
  start_server gpu-8b --arch llama-3.1-8b --random-weights --backend cuda --max-batch 64 \
    --max-context 4096 --kv-tokens 131072
  log "load"
  timeout $(( DEADLINE - SECONDS )) python3 $PY load "$URL" | tee "$OUT/load.jsonl"
  curl -s "$URL/metrics" | grep -E "^canopy_decode_" > "$OUT/decode-passes.txt"
  stop_server "$SERVER"
} 2>&1 | tee -a "$OUT/fields.txt"
