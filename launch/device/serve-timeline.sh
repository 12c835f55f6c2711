#!/usr/bin/env bash
# Where a served run's passes spend the GPU's time: `canopy bench serve` in process (8B shape,
# random weights, greedy; DATASET few-shot, METHOD auto, PROMPTS 192 at RATE 40 requests a
# second, 64 at a time) under a CUPTI activity trace, cut into passes at each embed_rows
# launch; the passes with prompt chunks (prefill_attention or causal_attention) told from the
# decode steps (tools/timeline.py --passes). Results: $OUT/serve-timeline.txt.
set -uo pipefail
source "$(dirname "$0")/env.sh"
{
  start_traced
  $BIN compile-kernels > /dev/null 2>&1 || echo "compile-kernels FAILED"
  CUDA_INJECTION64_PATH=$tracer CUPTI_TRACE_OUT=/tmp/serve.tsv $BIN bench serve \
    --arch llama-3.1-8b --random-weights --backend cuda --max-context 20480 --kv-tokens 131072 \
    --method "${METHOD:-auto}" --max-batch 64 --dataset "${DATASET:-few-shot}" \
    --num-prompts "${PROMPTS:-192}" --max-concurrency 64 --output-len 128 \
    --request-rate "${RATE:-40}" --temperature 0 | tail -4
  python3 "$(dirname "$0")/tools/timeline.py" /tmp/serve.tsv --passes embed_rows prefill_attention,causal_attention
} 2>&1 | tee "$OUT/serve-timeline.txt"
