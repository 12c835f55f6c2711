#!/usr/bin/env bash
# Where a decode step's time goes (issue 23, and the ring's hand-off): `bench decode` of the
# ARCH shape (default llama-3.1-8b; random weights and context, RANKS ranks (1), STRATEGY
# (tree), DECODE tokens at CONTEXT) for each of BINS ("name=path ..."), under a CUPTI activity
# trace (tools/cupti_trace.c via env.sh's build_tracer); with RUN=generate, `canopy generate`
# of the same instead, whose steps on several ranks all replay (bench decode's every other step
# times its merges, synchronised, eagerly). The trace is read by tools/timeline.py over the last
# STEPS intervals between MARKER launches (top_logits: two a step): GPU 0's busy share, its
# gaps, and kernel, copy and memset time by name per interval.
# Results: $OUT/steps-NAME.txt, log.txt.
set -uo pipefail
source "$(dirname "$0")/env.sh"
BINS=${BINS:-new=$BIN}
ARCH=${ARCH:-llama-3.1-8b}
CONTEXT=${CONTEXT:-8K}
DECODE=${DECODE:-30}
STEPS=${STEPS:-20}
MARKER=${MARKER:-top_logits}
RUN=${RUN:-bench}
{
  start_traced
  for entry in $BINS; do
    name=${entry%%=*} bin=${entry#*=}
    $bin compile-kernels > /dev/null 2>&1 || echo "compile-kernels FAILED: $name"
    log "$name: $RUN of $ARCH at $CONTEXT, $DECODE tokens, traced"
    if [ "$RUN" = generate ]; then
      CUDA_INJECTION64_PATH=$tracer CUPTI_TRACE_OUT=/tmp/steps-$name.tsv $bin generate \
        --arch "$ARCH" --random-weights --context-fill random --context "$CONTEXT" \
        --ranks "${RANKS:-1}" --strategy "${STRATEGY:-tree}" --max-tokens "$DECODE" --json 2>&1 \
        | grep -oE '"decode_ms_per_token":[0-9.]+'
    else
      CUDA_INJECTION64_PATH=$tracer CUPTI_TRACE_OUT=/tmp/steps-$name.tsv $bin bench decode \
        --arch "$ARCH" --random-weights --context-fill random --context "$CONTEXT" \
        --ranks "${RANKS:-1}" --strategy "${STRATEGY:-tree}" --decode "$DECODE" 2>&1 \
        | grep -E "^ *[0-9]+ +[0-9]+ " | head -3
    fi
    python3 "$(dirname "$0")/tools/timeline.py" "/tmp/steps-$name.tsv" --steps "$MARKER" "$STEPS" \
      | tee "$OUT/steps-$name.txt"
  done
} 2>&1 | tee "$OUT/log.txt"
