#!/usr/bin/env bash
# Whether builds decode alike: each binary of BINS (default: .device/canopy) runs `generate`
# of 16 greedy tokens after 8 prompt ids on the GPU, on each model of MODELS (files or
# directories, for example those load-times.sh writes), and one line a model says whether
# every binary gave the first one's tokens (a binary that fails counts as different).
# Results: $OUT/tokens.txt.
set -uo pipefail
source "$(dirname "$0")/env.sh"
BINS=${BINS:-$BIN}
for model in ${MODELS:?set MODELS to the models to decode}; do
  first="" verdict=same
  for bin in $BINS; do
    tokens=$("$bin" generate --model "$model" --prompt-ids 5,6,7,8,9,10,11,12 --max-tokens 16 \
      --backend cuda --temperature 0 --json 2>/dev/null |
      python3 -c 'import json, sys; print(json.load(sys.stdin)["samples"][0]["tokens"])' 2>/dev/null)
    [ -z "$first" ] && first=$tokens
    { [ -n "$tokens" ] && [ "$tokens" = "$first" ]; } || verdict=DIFFERENT
  done
  echo "$(basename "$model"): tokens $verdict: $first"
done | tee "$OUT/tokens.txt"
