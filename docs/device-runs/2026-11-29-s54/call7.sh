#!/usr/bin/env bash
# Session 54, call 7 (one H200): f16 tensors widened by half's slice conversion (`new`, the
# code of the commit after 602429d) against `prev` (602429d's build), which widened one value
# a call. generate's start on the 8B shape in f16 safetensors, converted to bf16 as read, warm
# (two rounds, binaries alternating); then the greedy tokens of base (ac43f93), prev and new,
# which must be the same.
set -uo pipefail
source launch/device/env.sh
export OUT
N=.device/canopy P=.device/canopy-prev B=.device/canopy-base
WORK=/tmp/canopy-load
log "writing the model"
FILES="f16" RUNS=0 OUT=/tmp/lt-make bash launch/device/load-times.sh > /dev/null 2>&1
log "warm"
FILES="f16" RUNS=1 BINS="$P $N $P $N" OUT=/tmp/lt-warm bash launch/device/load-times.sh > /dev/null 2>&1
cp /tmp/lt-warm/load-times.txt "$OUT/load-times-warm.txt"
grep -E "==|uploaded|time:|panicked" "$OUT/load-times-warm.txt" | sed 's/\x1b\[[0-9;]*m//g' | sed -E 's/.*weights uploaded/  uploaded/' | sed -E 's/backend="cuda" gb=[0-9.]+ //; s/gb_per_s=[0-9.]+ //'
for bin in $B $P $N; do
  $bin generate --model "$WORK/hf16" --prompt-ids 5,6,7,8,9,10,11,12 --max-tokens 16 --backend cuda \
    --temperature 0 --json 2> /dev/null | python3 -c 'import json, sys; print(json.load(sys.stdin)["samples"][0]["tokens"])' \
    > "/tmp/tokens-$(basename $bin)"
done
if cmp -s /tmp/tokens-canopy-base /tmp/tokens-canopy && cmp -s /tmp/tokens-canopy-prev /tmp/tokens-canopy; then r=same; else r=DIFFERENT; fi
echo "hf16: tokens $r: $(cat /tmp/tokens-canopy)" | tee -a "$OUT/tokens.txt"
log "done"
