#!/usr/bin/env bash
# Session 50, call 2 (one H200): where call 1's pairs lost. Nsight Compute over `bench tree` on
# the batch-64 shape (4,096-token prefix over 64 leaves of 16, auto): every stage-1 and merge
# kernel's duration for 6cb2401's build and the working tree's, then decode_partial_ws's warp
# states, scheduler and tensor-pipe figures.
set -uo pipefail
source launch/device/env.sh
export OUT
NCU=/usr/local/cuda/bin/ncu
tree_toml shared "1, 64" "4096, 16"
for side in canopy-base canopy; do
  echo "== $side" >> "$OUT/ncu.txt"
  $NCU --cache-control all --clock-control none -k regex:'decode_partial|merge_partials' \
    --launch-skip 6 --launch-count 6 --csv --print-units base \
    --metrics gpu__time_duration.sum,launch__grid_size,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active \
    .device/$side bench tree --workload /tmp/shared.toml --method auto --iterations 3 --check false 2>/dev/null \
    | grep -E '^"[0-9]' | awk -F'","' '{print $5, $(NF-2), $NF}' | sed 's/"//g' >> "$OUT/ncu.txt"
done
$NCU --cache-control all --clock-control none -k regex:'decode_partial_ws' --launch-skip 2 --launch-count 1 \
  --section WarpStateStats --section SchedulerStats --section SpeedOfLight --section Occupancy --section LaunchStats \
  .device/canopy bench tree --workload /tmp/shared.toml --method auto --iterations 3 --check false > "$OUT/ws-sections.txt" 2>&1
$NCU --cache-control all --clock-control none -k regex:'decode_partial_ws' --launch-skip 2 --launch-count 1 \
  --set full --import-source no -o /tmp/ws .device/canopy bench tree --workload /tmp/shared.toml --method auto --iterations 3 --check false > /dev/null 2>&1
$NCU -i /tmp/ws.ncu-rep --page source --csv --print-source sass 2>/dev/null | gzip > "$OUT/ws-sass.csv.gz"
ls -la $OUT
