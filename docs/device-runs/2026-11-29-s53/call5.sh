#!/usr/bin/env bash
# Session 53, call 5 (one H200): generate's start from a cold page cache with the next 512 MB
# of weights asked of the disk ahead of the reader (`new`, the working tree on 2455527:
# madvise(MADV_WILLNEED) per tensor) against `base` (2455527's build); one warm run of `new`
# each. First, what the disk gives to plain sequential reads of the shards, one and four at
# a time, from a cold cache.
set -uo pipefail
source launch/device/env.sh
export OUT
N=.device/canopy B=.device/canopy-base
WORK=/tmp/canopy-load
FILES="safetensors" RUNS=0 OUT=/tmp/lt-make bash launch/device/load-times.sh > /dev/null 2>&1
FILES="gguf" RUNS=0 OUT=/tmp/lt-make bash launch/device/load-times.sh > /dev/null 2>&1
drop() { python3 -c 'import os, sys
for path in sys.argv[1:]:
    fd = os.open(path, os.O_RDONLY); os.fsync(fd); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)' "$@"; }
{
  shards=("$WORK"/hf/*.safetensors)
  drop "${shards[@]}"
  start=$(date +%s.%N)
  dd if="${shards[0]}" of=/dev/null bs=16M 2>&1 | tail -1
  drop "${shards[@]}"
  start=$(date +%s.%N)
  for s in "${shards[@]}"; do dd if="$s" of=/dev/null bs=16M 2> /dev/null & done
  wait
  python3 -c "import os, sys; b = sum(os.path.getsize(p) for p in sys.argv[2:]); t = $(date +%s.%N) - float(sys.argv[1])
print(f'four shards at once: {b / 1e9:.2f} GB in {t:.2f} s, {b / 1e9 / t:.2f} GB/s')" "$start" "${shards[@]}"
} 2>&1 | tee "$OUT/disk.txt"
COLD=1 RUNS=1 BINS="$B $N $N" OUT=/tmp/lt-cold bash launch/device/load-times.sh > /dev/null 2>&1
cp /tmp/lt-cold/load-times.txt "$OUT/load-times-cold.txt"
RUNS=1 BINS="$N" OUT=/tmp/lt-warm bash launch/device/load-times.sh > /dev/null 2>&1
cp /tmp/lt-warm/load-times.txt "$OUT/load-times-warm.txt"
grep -E "==|uploaded|time:" "$OUT/load-times-cold.txt" "$OUT/load-times-warm.txt" | sed 's/\x1b\[[0-9;]*m//g' | sed -E 's/.*weights uploaded/  uploaded/'
