#!/usr/bin/env bash
# Where a sampled batch's decode step goes: `canopy generate` on the Llama-3.1-8B shape (random
# weights, whose flat rows put nearly every draw at a temperature past its 128 likeliest
# tokens), N samples (64) over a random CONTEXT-token prompt (4K), TOKENS tokens, for each
# SAMPLINGS entry (name=generate's options, `_` for a space; default greedy, temperature 1, and
# temperature 1 with top_p 0.9), under a CUPTI activity trace read by tools/timeline.py over
# the last STEPS intervals between embed_rows launches (one a pass), and timed untraced
# (generate --json's decode ms/token). Results: $OUT/sampling-steps.txt.
set -uo pipefail
source "$(dirname "$0")/env.sh"
SAMPLINGS=${SAMPLINGS:-greedy=--temperature_0 t1=--temperature_1 top-p=--temperature_1_--top-p_0.9}
{
  start_traced
  $BIN compile-kernels > /dev/null 2>&1 || echo "compile-kernels FAILED"
  for entry in $SAMPLINGS; do
    name=${entry%%=*} opts=${entry#*=}
    opts=${opts//_/ }
    gen() {
      $BIN generate --arch llama-3.1-8b --random-weights --context-fill random \
        --context "${CONTEXT:-4K}" --n "${N:-64}" --max-tokens "${TOKENS:-24}" $opts "$@"
    }
    log "$name ($opts): untimed"
    gen --json | python3 -c "import json,sys; r=json.load(sys.stdin); print({k: v for k, v in r.items() if 'decode' in k or 'step' in k})" \
      || echo "generate FAILED"
    log "$name ($opts): traced"
    CUDA_INJECTION64_PATH=$tracer CUPTI_TRACE_OUT=/tmp/$name.tsv gen > /dev/null
    python3 "$(dirname "$0")/tools/timeline.py" /tmp/$name.tsv --steps embed_rows "${STEPS:-8}"
  done
} 2>&1 | tee "$OUT/sampling-steps.txt"
