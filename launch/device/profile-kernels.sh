#!/usr/bin/env bash
# Nsight Compute's detail sections (speed of light, memory workload, warp stalls, occupancy,
# launch) at the GPU's own clocks for the kernels that bound a decode step: the GEMVs of a
# batch-1 step (`bench decode`, 8B shape, 8K, past the first steps) and the attention and merge
# of a batch-64 step over a shared 4K prompt (`generate --n 64 --eager`). Results:
# $OUT/gemv.txt and $OUT/batch64.txt.
set -uo pipefail
source "$(dirname "$0")/env.sh"
SECTIONS=(--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats
  --section Occupancy --section LaunchStats --section SchedulerStats --clock-control none)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
ncu "${SECTIONS[@]}" -k regex:gemv --launch-skip "${GEMV_SKIP:-400}" --launch-count 8 \
  $BIN bench decode --arch llama-3.1-8b --random-weights --context-fill random --context 8K \
  --ranks 1 --strategy tree --decode 8 --eager > "$OUT/gemv.txt" 2>&1
echo "gemv: ncu exit $?"
ncu "${SECTIONS[@]}" -k regex:"decode_partial_mma|merge_partials" --launch-skip "${ATTN_SKIP:-200}" \
  --launch-count 4 $BIN generate --arch llama-3.1-8b --random-weights --context-fill random \
  --context 4K --n 64 --max-tokens 10 --eager > "$OUT/batch64.txt" 2>&1
echo "batch64: ncu exit $?"
