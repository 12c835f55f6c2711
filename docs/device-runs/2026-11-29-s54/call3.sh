#!/usr/bin/env bash
# Session 54, call 3 (one H200): an upload no longer waits for each weight's last copy before
# the next weight's first part is read; the model's upload waits once, at its end
# (`LayerOps::finish_uploads`). `new` is the working tree on 69ea644, `prev` 69ea644's build,
# `base` ac43f93's. The device tests of the new build (the weight upload now read on a second
# backend's stream after finish_uploads), then generate's start on load-times.sh's two
# 8B-shaped files, warm (prev and new alternating) and cold (new), then the greedy tokens of
# base and new on each file, which must be the same.
set -uo pipefail
source launch/device/env.sh
export OUT
N=.device/canopy P=.device/canopy-prev B=.device/canopy-base
WORK=/tmp/canopy-load
device_tests > /dev/null
grep -E "test result|panicked" "$OUT/tests.txt"
log "writing the models"
FILES="safetensors" RUNS=0 OUT=/tmp/lt-make bash launch/device/load-times.sh > /dev/null 2>&1
FILES="gguf" RUNS=0 OUT=/tmp/lt-make bash launch/device/load-times.sh > /dev/null 2>&1
log "warm"
RUNS=1 BINS="$P $N $P $N $P $N" OUT=/tmp/lt-warm bash launch/device/load-times.sh > /dev/null 2>&1
cp /tmp/lt-warm/load-times.txt "$OUT/load-times-warm.txt"
log "cold"
COLD=1 RUNS=2 BINS="$N" OUT=/tmp/lt-cold bash launch/device/load-times.sh > /dev/null 2>&1
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
