#!/usr/bin/env bash
# Where a batched decode pass's time goes (issue 24's batch-64 pass): `canopy generate` on the
# Llama-3.1-8B shape (random weights), N samples (64) sharing a random CONTEXT-token prompt (4K,
# the few-shot dataset's prefix), TOKENS tokens, under a CUPTI activity trace (env.sh's
# build_tracer), read by tools/timeline.py over the last STEPS intervals between MARKER
# launches (embed_rows: one a pass). Results: $OUT/batch-steps.txt.
set -uo pipefail
source "$(dirname "$0")/env.sh"
{
  start_traced
  $BIN compile-kernels > /dev/null 2>&1 || echo "compile-kernels FAILED"
  log "generate --n ${N:-64} at ${CONTEXT:-4K}, ${TOKENS:-24} tokens, traced"
  CUDA_INJECTION64_PATH=$tracer CUPTI_TRACE_OUT=/tmp/batch.tsv $BIN generate --arch llama-3.1-8b \
    --random-weights --context-fill random --context "${CONTEXT:-4K}" --n "${N:-64}" \
    --max-tokens "${TOKENS:-24}" > /dev/null
  python3 "$(dirname "$0")/tools/timeline.py" /tmp/batch.tsv --steps "${MARKER:-embed_rows}" "${STEPS:-8}"
} 2>&1 | tee "$OUT/batch-steps.txt"
