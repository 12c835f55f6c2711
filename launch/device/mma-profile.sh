#!/usr/bin/env bash
# Where the tensor-core kernel's time goes: ncu's speed-of-light, pipe utilisation, warp stalls
# and occupancy for one stage-1 launch per spec, beside the event-timed step of `bench tree`.
# SPECS lists "workload kv-heads method" triples; a workload is a built-in name or a TOML path.
# `root-2048` is FastTree tree 4's root alone (1024 one-token leaves), to isolate the many-row path.
set -uo pipefail
source "$(dirname "$0")/env.sh"
NCU=${NCU:-/usr/local/cuda/bin/ncu}
tree_toml root-2048 "1, 1024" "2048, 1"
SPECS=${SPECS:-"/tmp/root-2048.toml 8 fasttree|fasttree-4 8 fasttree|fasttree-7 8 fasttree|fasttree-9 8 fasttree"}
SECTIONS=${SECTIONS:---section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats}
IFS='|' read -ra specs <<< "$SPECS"
{
  for spec in "${specs[@]}"; do
    read -r w kv m <<< "$spec"
    echo "== $w 32/$kv $m"
    $BIN bench tree --workload $w --heads 32 --kv-heads $kv --head-dim 128 --dtype f16 \
      --method $m --iterations 20 --check false --json \
      | grep -o '"median_us": [0-9.]*\|"stage1_us": [0-9.]*' | paste -sd' '
    $NCU --cache-control all --clock-control none -k regex:'decode_partial' \
      --launch-skip ${SKIP:-3} --launch-count 1 $SECTIONS \
      $BIN bench tree --workload $w --heads 32 --kv-heads $kv --head-dim 128 --dtype f16 \
      --method $m --iterations 3 --check false 2>&1 | grep -v '^==PROF==' | sed -n '/decode_partial/,$p'
  done
} 2>&1 | tee "$OUT/mma-profile-log.txt"
