#!/usr/bin/env bash
# Issue 24: the decode attention of one layer of the trees `bench serve`'s shared-prefix
# datasets make at 64 in flight (configs/workloads/serve-*.toml), on its own: every method
# timed and checked against the f64 oracle (`bench tree`), then Nsight Compute over `auto`'s
# kernels (caches flushed before each, clocks as run). Beside each, the KV floor: the plan's
# distinct KV bytes over the copy bandwidth. Results: $OUT/serving-trees.txt, $OUT/tree-*.json.
set -uo pipefail
source "$(dirname "$0")/env.sh"
NCU=${NCU:-/usr/local/cuda/bin/ncu}
TREES=${TREES:-few-shot multi-doc multi-chain system-prompt}
METRICS=gpu__time_duration.sum,launch__grid_size,launch__registers_per_thread,launch__occupancy_limit_shared_mem,sm__warps_active.avg.pct_of_peak_sustained_active,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  for t in $TREES; do
    w=configs/workloads/serve-$t.toml
    log "$t: every method"
    $BIN bench tree --workload $w --iterations ${ITER:-20} --json > "$OUT/tree-$t.json"
    $BIN bench tree --workload $w --iterations ${ITER:-20} 2>&1 | tail -12
    log "$t: ncu, auto"
    $NCU --cache-control all --clock-control none -k regex:'decode_partial|merge_partials' \
      --launch-skip 6 --launch-count 4 --csv --print-units base --metrics $METRICS \
      $BIN bench tree --workload $w --method auto --iterations 3 --check false 2>/dev/null \
      | grep -E '^"[0-9]' | awk -F'","' '{print $5, $(NF-2), $NF}' | sed 's/"//g'
  done
} 2>&1 | tee "$OUT/serving-trees.txt"
