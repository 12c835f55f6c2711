#!/usr/bin/env bash
# The decode GEMV's source variants in one call: the layer-op tests on the embedded sources
# (the GEMV against the CPU and f64), then kernel-variants.sh (every folder of
# .device/variants, ROUNDS rounds) on the Llama-3.1-8B shape at CONTEXTS and on the
# Llama-3.2-1B shape at 8K. Results: $OUT/layer-ops.txt, $OUT/8b/ and $OUT/1b/.
set -uo pipefail
source "$(dirname "$0")/env.sh"
DEADLINE=${DEADLINE:-540}
log "layer-op tests"
.device/layer_ops --test-threads 1 2>&1 | tail -15 | tee "$OUT/layer-ops.txt"
log "variants, 8B"
OUT=$OUT/8b ARCH=llama-3.1-8b CONTEXTS=${CONTEXTS:-8K,32K} DEADLINE=$((DEADLINE * 3 / 4 - SECONDS)) \
  bash "$(dirname "$0")/kernel-variants.sh" > /dev/null
log "variants, 1B"
OUT=$OUT/1b ARCH=llama-3.2-1b CONTEXTS=8K DEADLINE=$(left) ROUNDS=1 \
  bash "$(dirname "$0")/kernel-variants.sh" > /dev/null
log "done"
cat "$OUT"/8b/variants.jsonl "$OUT"/1b/variants.jsonl
