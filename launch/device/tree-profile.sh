#!/usr/bin/env bash
# Where a small tree's step goes: per-kernel duration, grid, DRAM bytes and throughput from ncu
# (caches flushed before each kernel, clocks left alone) beside the event-timed step of
# `bench tree`. SPECS lists "tree kv-heads method" triples. Used to steer kernel work; results
# under $OUT.
set -uo pipefail
source "$(dirname "$0")/env.sh"
NCU=${NCU:-/usr/local/cuda/bin/ncu}
METRICS=${METRICS:-gpu__time_duration.sum,launch__grid_size,launch__occupancy_limit_shared_mem,dram__bytes_read.sum,dram__bytes_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active}
SPECS=${SPECS:-"1 8 fasttree|5 8 deft-node-chunk|8 8 deft-node-chunk|9 8 fasttree|1 32 fasttree|5 32 deft-node|8 32 deft-node|3 32 fasttree"}
IFS='|' read -ra specs <<< "$SPECS"
{
  for spec in "${specs[@]}"; do
    read -r t kv m <<< "$spec"
    echo "== fasttree-$t 32/$kv $m"
    $BIN bench tree --workload fasttree-$t --heads 32 --kv-heads $kv --head-dim 128 --dtype f16 \
      --method $m --iterations 20 --check false --json \
      | grep -o '"median_us": [0-9.]*\|"stage1_us": [0-9.]*' | paste -sd' '
    $NCU --cache-control all --clock-control none -k regex:'decode_partial|merge_partials' \
      --launch-skip ${SKIP:-6} --launch-count ${COUNT:-3} --csv --print-units base --metrics $METRICS ${SECTIONS:-} \
      $BIN bench tree --workload fasttree-$t --heads 32 --kv-heads $kv --head-dim 128 --dtype f16 \
      --method $m --iterations 3 --check false 2>/dev/null \
      | grep -E '^"[0-9]' | awk -F'","' '{print $5, $(NF-2), $NF}' | sed 's/"//g'
  done
} 2>&1 | tee "$OUT/profile-log.txt"
