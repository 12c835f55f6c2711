#!/usr/bin/env bash
# Session 53, call 6 (one H200): generate's start with the prefetch hint of call 5 and
# unquantized tensors read from the file (pread in 4 MB pieces on every core) instead of
# through the mapping (`new`, the working tree on 2455527) against `base` (2455527's build),
# from a cold page cache and a warm one; then both binaries' greedy tokens on each file,
# which must be the same.
set -uo pipefail
source launch/device/env.sh
export OUT
N=.device/canopy B=.device/canopy-base
WORK=/tmp/canopy-load
FILES="safetensors" RUNS=0 OUT=/tmp/lt-make bash launch/device/load-times.sh > /dev/null 2>&1
FILES="gguf" RUNS=0 OUT=/tmp/lt-make bash launch/device/load-times.sh > /dev/null 2>&1
COLD=1 RUNS=1 BINS="$B $N $N" OUT=/tmp/lt-cold bash launch/device/load-times.sh > /dev/null 2>&1
cp /tmp/lt-cold/load-times.txt "$OUT/load-times-cold.txt"
RUNS=1 BINS="$B $N $B $N" OUT=/tmp/lt-warm bash launch/device/load-times.sh > /dev/null 2>&1
cp /tmp/lt-warm/load-times.txt "$OUT/load-times-warm.txt"
grep -E "==|uploaded|time:" "$OUT/load-times-cold.txt" "$OUT/load-times-warm.txt" | sed 's/\x1b\[[0-9;]*m//g' | sed -E 's/.*weights uploaded/  uploaded/'
for model in "$WORK/hf" "$WORK/big.gguf"; do
  for bin in $B $N; do
    $bin generate --model "$model" --prompt-ids 5,6,7,8,9,10,11,12 --max-tokens 16 --backend cuda \
      --temperature 0 --json 2> /dev/null | python3 -c 'import json, sys; print(json.load(sys.stdin)["samples"][0]["tokens"])' \
      > "/tmp/tokens-$(basename $bin)"
  done
  if cmp -s /tmp/tokens-canopy-base /tmp/tokens-canopy; then r=same; else r=DIFFERENT; fi
  echo "$(basename $model): tokens $r: $(cat /tmp/tokens-canopy)" | tee -a "$OUT/tokens.txt"
done
