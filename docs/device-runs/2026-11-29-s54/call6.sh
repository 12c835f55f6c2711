#!/usr/bin/env bash
# Session 54, call 6 (one H200): tensors not stored in the compute dtype read from the file in
# pieces of one decoding task (64K elements) each, decoded by the thread that read the piece
# (`new`, the code of the commit after b2948dd), against `prev` (1b5a352's build), which
# decodes them from the mapping. In call 5 the pieces were 1 MB of stored bytes: a few per
# part for a K-quant, each decoded by a nested parallel loop. generate's start on the 8B shape
# in f16 safetensors (converted to bf16 as read) and as the K-quant GGUF, warm (three rounds,
# binaries alternating) and cold (one round); then the greedy tokens of base, prev and new on
# each file, which must be the same.
set -uo pipefail
source launch/device/env.sh
export OUT
N=.device/canopy P=.device/canopy-prev B=.device/canopy-base
WORK=/tmp/canopy-load
log "writing the models"
FILES="f16" RUNS=0 OUT=/tmp/lt-make bash launch/device/load-times.sh > /dev/null 2>&1
FILES="gguf" RUNS=0 OUT=/tmp/lt-make bash launch/device/load-times.sh > /dev/null 2>&1
log "warm"
FILES="f16 gguf" RUNS=1 BINS="$P $N $P $N $P $N" OUT=/tmp/lt-warm bash launch/device/load-times.sh > /dev/null 2>&1
cp /tmp/lt-warm/load-times.txt "$OUT/load-times-warm.txt"
log "cold"
FILES="f16 gguf" COLD=1 RUNS=1 BINS="$N $P" OUT=/tmp/lt-cold bash launch/device/load-times.sh > /dev/null 2>&1
cp /tmp/lt-cold/load-times.txt "$OUT/load-times-cold.txt"
grep -E "==|uploaded|time:|panicked" "$OUT/load-times-warm.txt" "$OUT/load-times-cold.txt" | sed 's/\x1b\[[0-9;]*m//g' | sed -E 's/.*weights uploaded/  uploaded/' | sed -E 's/backend="cuda" gb=[0-9.]+ //; s/gb_per_s=[0-9.]+ //'
for model in "$WORK/hf16" "$WORK/big.gguf"; do
  for bin in $B $P $N; do
    $bin generate --model "$model" --prompt-ids 5,6,7,8,9,10,11,12 --max-tokens 16 --backend cuda \
      --temperature 0 --json 2> /dev/null | python3 -c 'import json, sys; print(json.load(sys.stdin)["samples"][0]["tokens"])' \
      > "/tmp/tokens-$(basename $bin)"
  done
  if cmp -s /tmp/tokens-canopy-base /tmp/tokens-canopy && cmp -s /tmp/tokens-canopy-prev /tmp/tokens-canopy; then r=same; else r=DIFFERENT; fi
  echo "$(basename $model): tokens $r: $(cat /tmp/tokens-canopy)" | tee -a "$OUT/tokens.txt"
done
log "done"
