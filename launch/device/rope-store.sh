#!/usr/bin/env bash
# RoPE fused into the KV append, this build against BASE (default .device/canopy-base): the
# layer-op tests and the graph test, ab-decode.sh (ARCHS, default the 8B and SmolLM2 shapes, at
# 8K and 32K, two rounds), then the model-check subset (fixtures f32 and bf16 on 1 and 3 ranks,
# the device-made tiny model, the 8B shape on 1 rank tree and 2 ranks ring) within DEADLINE.
# Results: $OUT/tests.txt, $OUT/ab/, $OUT/model-check/.
set -uo pipefail
source "$(dirname "$0")/env.sh"
DEADLINE=${DEADLINE:-560}
{
  device_tests
  log "decode A/B"
  OUT=$OUT/ab BINS="new=$BIN base=${BASE:-.device/canopy-base}" ARCHS="${ARCHS:-llama-3.1-8b smollm2-135m}" \
    DEADLINE=$((DEADLINE / 2)) DECODE=30 bash "$(dirname "$0")/ab-decode.sh" > /dev/null
  cat "$OUT/ab/ab.jsonl"
  log "model check"
  OUT=$OUT/model-check FIXTURE_CASES="f32:1:tree bf16:1:tree f32:3:ring bf16:3:tree" \
    TINY_CASES="f32:1:tree bf16:2:ring" BIG_CASES="bf16:1:tree bf16:2:ring" \
    DEADLINE=$(left) bash "$(dirname "$0")/model-check.sh" > /dev/null 2>&1
  tail -3 "$OUT/model-check/model-check-log.txt"
} 2>&1 | tee "$OUT/log.txt"
