#!/usr/bin/env bash
# The decode attention per layer inside the model's step (issue 23's per-layer goal: ≥ 90% of
# the copy bandwidth at 32K, ≥ 95% from 128K): `bench decode` of the Llama-3.1-8B shape (random
# weights and context, one rank, tree, DECODE tokens) at each of CONTEXTS under a CUPTI trace
# (env.sh's build_tracer), read by tools/attention_spans.py over the last 5 steps' launches
# against the layer's KV bytes and the copy bandwidth the run measured.
# Results: $OUT/attention-in-step.txt.
set -uo pipefail
source "$(dirname "$0")/env.sh"
{
  start_traced
  $BIN compile-kernels > /dev/null 2>&1 || echo "compile-kernels FAILED"
  for context in ${CONTEXTS:-8K 32K 128K 500K}; do
    log "bench decode at $context, traced"
    CUDA_INJECTION64_PATH=$tracer CUPTI_TRACE_OUT=/tmp/attention.tsv $BIN bench decode \
      --arch llama-3.1-8b --random-weights --context-fill random --context "$context" --ranks 1 \
      --strategy tree --decode "${DECODE:-12}" --json > /tmp/attention.json 2> /dev/null
    # The layer's KV at the last step: (context + the steps' tokens) × 8 KV heads × 128 × K and V × 2 bytes.
    read -r kv gb ms <<< "$(python3 -c 'import json; d = json.load(open("/tmp/attention.json")); r = d["rows"][0]
print((r["context"] + '"${DECODE:-12}"') * 8 * 128 * 2 * 2, d["copy_bandwidth_gb_s"], r["decode_ms_per_token"])')"
    echo "step ${ms} ms; copy ${gb} GB/s"
    python3 "$(dirname "$0")/tools/attention_spans.py" /tmp/attention.tsv "$kv" "$gb" 160
  done
} 2>&1 | tee "$OUT/attention-in-step.txt"
