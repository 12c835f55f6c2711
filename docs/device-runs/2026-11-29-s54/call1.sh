#!/usr/bin/env bash
# Session 54, call 1 (one H200): weights read straight into the upload's page-locked buffers
# (`new`, the working tree on ac43f93) against `base` (ac43f93's build). First the device
# tests of the new build (the weight-upload test now also uploads by parts and fails a
# reader); then generate's start on load-times.sh's two 8B-shaped files, warm and cold,
# alternating the binaries; then both binaries' greedy tokens on each file, which must be the
# same.
set -uo pipefail
source launch/device/env.sh
export OUT
N=.device/canopy B=.device/canopy-base
WORK=/tmp/canopy-load
device_tests > /dev/null
grep -E "test result|panicked" "$OUT/tests.txt"
log "writing the models"
FILES="safetensors" RUNS=0 OUT=/tmp/lt-make bash launch/device/load-times.sh > /dev/null 2>&1
FILES="gguf" RUNS=0 OUT=/tmp/lt-make bash launch/device/load-times.sh > /dev/null 2>&1
log "warm"
RUNS=1 BINS="$B $N $B $N" OUT=/tmp/lt-warm bash launch/device/load-times.sh > /dev/null 2>&1
cp /tmp/lt-warm/load-times.txt "$OUT/load-times-warm.txt"
log "cold"
COLD=1 RUNS=1 BINS="$B $N $N $B" OUT=/tmp/lt-cold bash launch/device/load-times.sh > /dev/null 2>&1
cp /tmp/lt-cold/load-times.txt "$OUT/load-times-cold.txt"
grep -E "==|uploaded|time:" "$OUT/load-times-warm.txt" "$OUT/load-times-cold.txt" | sed 's/\x1b\[[0-9;]*m//g' | sed -E 's/.*weights uploaded/  uploaded/'
for model in "$WORK/hf" "$WORK/big.gguf"; do
  for bin in $B $N; do
    $bin generate --model "$model" --prompt-ids 5,6,7,8,9,10,11,12 --max-tokens 16 --backend cuda \
      --temperature 0 --json 2> /dev/null | python3 -c 'import json, sys; print(json.load(sys.stdin)["samples"][0]["tokens"])' \
      > "/tmp/tokens-$(basename $bin)"
  done
  if cmp -s /tmp/tokens-canopy-base /tmp/tokens-canopy; then r=same; else r=DIFFERENT; fi
  echo "$(basename $model): tokens $r: $(cat /tmp/tokens-canopy)" | tee -a "$OUT/tokens.txt"
done
log "done"
