#!/usr/bin/env bash
# The server's request fields that read whole logits rows on the GPU (log-probabilities,
# penalties, logit_bias) and several prompts per request:
# 1. the tiny fixture model (f32) served on the GPU and on the CPU answer the same requests
#    alike (serve_fields.py check);
# 2. the 8B shape with random weights (bf16) under CONCURRENCY streamed completions, timed
#    with none, one or all of them asking for log-probabilities, and all penalised
#    (serve_fields.py load), for each binary of BINS (name=path; default this build alone).
# Run from the repository root on the device machine with the release binary in .device/.
# Results: $OUT/fields.txt, $OUT/load.jsonl, the decode passes' metrics and the servers' logs.
set -uo pipefail
source "$(dirname "$0")/env.sh"
DEADLINE=${DEADLINE:-480}
TINY=tests/fixtures/tiny/gqa-hd64
PY=launch/device/serve_fields.py
# The servers' logs travel as one archive.
trap 'tar czf "$OUT/server-logs.tgz" -C "$OUT" $(cd "$OUT" && ls server-*.log) && rm -f "$OUT"/server-*.log' EXIT

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

load_each_bin $PY 2>&1 | tee -a "$OUT/fields.txt"
