#!/usr/bin/env bash
# Where a decode step's time goes: `bench decode` on the Llama-3.1-8B shape (random weights,
# random context, one rank), then the same under Nsight Compute, each kernel's duration and
# DRAM bytes for the first LAUNCHES launches (the fill's stores, then the decode steps) as CSV
# in $OUT/kernels.csv. ARCH, CONTEXT, DECODE and LAUNCHES narrow the run.
set -uo pipefail
source "$(dirname "$0")/env.sh"
ARGS=(bench decode --arch "${ARCH:-llama-3.1-8b}" --random-weights --context-fill random
  --context "${CONTEXT:-8K}" --ranks 1 --strategy tree)
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  $BIN "${ARGS[@]}" --decode "${DECODE:-20}"
  ncu --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum --csv \
    --launch-count "${LAUNCHES:-1600}" $BIN "${ARGS[@]}" --decode 3 > "$OUT/kernels.csv" 2> "$OUT/ncu-err.txt"
  echo "ncu exit $?; $(wc -l < "$OUT/kernels.csv") lines"
} 2>&1 | tee "$OUT/profile-log.txt"
