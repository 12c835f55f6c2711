#!/usr/bin/env bash
# Session 50, call 8 (one H200): the fixed phases of the shipping kernel's shared-prefix CTAs.
# Nsight Compute's durations of decode_partial_mma on the batch-64 shape (`shared`, auto) for the
# build of 4fbcaa9 and three diagnostic variants of its warpgroup path (results not checked):
# `noq` (Q fragments made in registers, no loads), `nostore` (no partial rows stored), `neither`.
set -uo pipefail
source launch/device/env.sh
export OUT
NCU=/usr/local/cuda/bin/ncu
tree_toml shared "1, 64" "4096, 16"
for v in crate noq nostore neither; do
  envs=""
  [ $v != crate ] && envs="CANOPY_KERNEL_SOURCES=.device/variants/$v CANOPY_KERNEL_CACHE=/tmp/kc-$v"
  echo "== $v" >> "$OUT/ncu.txt"
  env $envs $NCU --cache-control all --clock-control none -k regex:'decode_partial_mma' \
    --launch-skip 4 --launch-count 3 --csv --print-units base \
    --metrics gpu__time_duration.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active \
    $BIN bench tree --workload /tmp/shared.toml --method auto --iterations 3 --check false 2>/dev/null \
    | grep -E '^"[0-9]' | awk -F'","' '{print $5, $(NF-2), $NF}' | sed 's/"//g' >> "$OUT/ncu.txt"
done
cat "$OUT/ncu.txt"
