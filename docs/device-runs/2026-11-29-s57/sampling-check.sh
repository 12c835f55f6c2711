#!/usr/bin/env bash
# A build's sampling on the GPU, checked and timed with the standard load generator:
# 1. the device tests, and the tiny fixture model (f32) served on the GPU against `generate`
#    with the same seeds, penalised or not (serve_fields.py sampled);
# 2. every request field on the GPU against the CPU (serve_fields.py check), and
#    `generate --logprobs` on the GPU against the CPU;
# 3. `model-check.sh` against transformers (DEADLINE 110 s);
# 4. `canopy bench serve` on the 8B shape with random weights (few-shot: 128 requests behind
#    one 4K-token prompt, 64 at a time, 128 tokens each), greedy, at temperature 1 (OpenAI's
#    default) and at temperature 1 with top_p 0.9.
# Run from the repository root on the device machine with the release binary in .device/.
# Results: $OUT/check.txt, $OUT/bench-*.json, and the model check's files.
set -uo pipefail
source "$(dirname "$0")/env.sh"
DEADLINE=${DEADLINE:-560}
TINY=tests/fixtures/tiny/gqa-hd64
PY=launch/device/serve_fields.py
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  device_tests
  python3 -c "import json; print(json.dumps([p['token_ids'] for p in json.load(open('$TINY/reference.json'))['prompts']]))" > /tmp/prompts.json
  start_server gpu-tiny --model $TINY --backend cuda --dtype f32 && GPU_PID=$SERVER GPU_URL=$URL
  start_server cpu-tiny --model $TINY --backend cpu && CPU_PID=$SERVER CPU_URL=$URL
  log "sampled: served against generate, on the GPU"
  python3 $PY sampled "$GPU_URL" "$BIN" $TINY /tmp/prompts.json
  log "check: the GPU against the CPU"
  python3 $PY check "$GPU_URL" "$CPU_URL" /tmp/prompts.json
  stop_server "$GPU_PID"
  stop_server "$CPU_PID"
  log "generate --logprobs"
  bash launch/device/generate-logprobs.sh
  log "model check"
  DEADLINE=110 bash launch/device/model-check.sh > "$OUT/model-check.txt" 2>&1
  tail -1 "$OUT/model-check.txt"
  rm -f "$OUT/model-check-runs.tgz" "$OUT"/gen-*
  for sampling in "greedy" "t1:--temperature 1" "top-p:--temperature 1 --top-p 0.9"; do
    name=${sampling%%:*} flags=${sampling#*:}
    [ "$name" = greedy ] && flags=
    log "bench serve, $name"
    timeout $(( DEADLINE - SECONDS )) $BIN bench serve --arch llama-3.1-8b --random-weights \
      --backend cuda --max-context 8192 --kv-tokens 131072 --max-batch 64 --dataset few-shot \
      --prefix-len 4096 --num-prompts 128 --max-concurrency 64 --output-len 128 $flags \
      --json > "$OUT/bench-$name.json" 2> "$OUT/bench-$name.err"
    python3 -c "import json; r=json.load(open('$OUT/bench-$name.json')); print('$name', r['completed'], 'completed,', round(r['output_throughput']), 'output tokens/s, TPOT median', round(r['tpot_ms']['median'], 2), 'ms')"
  done
} 2>&1 | tee "$OUT/check.txt"
