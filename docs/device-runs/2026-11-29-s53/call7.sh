#!/usr/bin/env bash
# Session 53, call 7 (one H200): call 6's `new` against the same build without the prefetch
# hint (`nopf`: unquantized tensors read by pread alone), safetensors from a cold page cache,
# twice each in turn.
set -uo pipefail
source launch/device/env.sh
export OUT
N=.device/canopy P=.device/canopy-nopf
FILES="safetensors" RUNS=0 OUT=/tmp/lt-make bash launch/device/load-times.sh > /dev/null 2>&1
COLD=1 RUNS=1 FILES=safetensors BINS="$N $P $N $P" OUT=/tmp/lt-cold bash launch/device/load-times.sh > /dev/null 2>&1
cp /tmp/lt-cold/load-times.txt "$OUT/load-times-cold.txt"
grep -E "==|uploaded|time:" "$OUT/load-times-cold.txt" | sed 's/\x1b\[[0-9;]*m//g' | sed -E 's/.*(seconds=[0-9.]+).*(read_s=[0-9.]+) (upload_s=[0-9.]+)/  \1 \2 \3/'
