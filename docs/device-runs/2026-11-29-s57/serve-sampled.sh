#!/usr/bin/env bash
# Draws at a temperature over the whole vocabulary (no top_k, as OpenAI's clients send them),
# with penalties or without, which read narrowed rows, their softmax totals and the changed
# tokens' logits, and rows whole only where those do not settle a draw:
# 1. the device tests (logit_ops holds softmax_totals to the CPU's f64 sums, and pick_logits
#    to the CPU's bits);
# 2. the tiny fixture model (f32) served on the GPU: seeded completions, some penalised, all in
#    flight at once, against `generate` on the GPU with the same seeds and penalties
#    (serve_fields.py sampled);
# 3. the 8B shape with random weights (bf16) under CONCURRENCY streamed completions, timed in
#    VARIANTS (serve_fields.py load; default greedy, temperature 1, 0.1, top_p 0.9, top_k 40),
#    for each binary of BINS (name=path; default this build alone).
# RANKS (default 1) sets the ranks of every server and of `generate`: one a GPU where the machine
# has them.
# Run from the repository root on the device machine with the release binary in .device/.
# Results: $OUT/sampled.txt, $OUT/tests.txt, $OUT/load.jsonl, the decode passes' metrics and
# the servers' logs.
set -uo pipefail
source "$(dirname "$0")/env.sh"
DEADLINE=${DEADLINE:-480}
TINY=tests/fixtures/tiny/gqa-hd64
PY=launch/device/serve_fields.py
export VARIANTS=${VARIANTS:-warm greedy t1 t01 top-p top-k greedy t1}
trap 'tar czf "$OUT/server-logs.tgz" -C "$OUT" $(cd "$OUT" && ls server-*.log) && rm -f "$OUT"/server-*.log' EXIT

{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  device_tests
  python3 -c "import json; print(json.dumps([p['token_ids'] for p in json.load(open('$TINY/reference.json'))['prompts']]))" > /tmp/prompts.json
  start_server gpu-tiny --model $TINY --backend cuda --dtype f32 --ranks "${RANKS:-1}"
  log "sampled: served against generate, on the GPU"
  python3 $PY sampled "$URL" "$BIN" $TINY /tmp/prompts.json
  stop_server
} 2>&1 | tee "$OUT/sampled.txt"

load_each_bin $PY 2>&1 | tee -a "$OUT/sampled.txt"
