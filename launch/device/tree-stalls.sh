#!/usr/bin/env bash
# Why a shared-prefix decode attention takes what it takes: Nsight Compute's speed-of-light,
# occupancy, warp-state and memory sections over one `decode_partial_mma` launch of METHOD
# (deft-node) on a tree of one PREFIX-token node over LEAVES one-query leaves of LEAF tokens
# (32/8 heads x 128, f16, one rank; the batch-64 serving pass's shape by default), then the
# warps' stall reasons per issued instruction and the sampled source lines. SASS=true also
# writes the sampled stalls of every SASS instruction ($OUT/sass.csv.gz, Nsight Compute's
# source page) and adds their sum by piece of code (tools/sass_regions.py).
# Results: $OUT/tree-stalls.txt.
set -uo pipefail
source "$(dirname "$0")/env.sh"
NCU=${NCU:-/usr/local/cuda/bin/ncu}
tree_toml shared "1, ${LEAVES:-64}" "${PREFIX:-4096}, ${LEAF:-16}"
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  $BIN bench tree --workload /tmp/shared.toml --method "${METHOD:-deft-node}" --iterations 10 2>&1 | tail -3
  $NCU --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
    --section MemoryWorkloadAnalysis --section LaunchStats -k regex:decode_partial_mma \
    --launch-skip 3 --launch-count 1 $BIN bench tree --workload /tmp/shared.toml \
    --method "${METHOD:-deft-node}" --iterations 3 --check false 2>&1 | grep -vE "^==PROF==|^ *-+ *$"
  $NCU --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" --section SourceCounters \
    -k regex:decode_partial_mma --launch-skip 3 --launch-count 1 $BIN bench tree \
    --workload /tmp/shared.toml --method "${METHOD:-deft-node}" --iterations 3 --check false 2>&1 \
    | grep -vE "^==PROF==|^ *-+ *$" | awk '$NF != "0" || !/stalled/'
} 2>&1 | tee "$OUT/tree-stalls.txt"
if [ "${SASS:-false}" = true ]; then
  $NCU --section SourceCounters --section WarpStateStats -k regex:decode_partial_mma --launch-skip 3 \
    --launch-count 1 -f -o /tmp/tree-stalls $BIN bench tree --workload /tmp/shared.toml \
    --method "${METHOD:-deft-node}" --iterations 3 --check false > /dev/null 2>&1
  $NCU -i /tmp/tree-stalls.ncu-rep --page source --print-source sass --csv | gzip > "$OUT/sass.csv.gz"
  python3 "$(dirname "$0")/tools/sass_regions.py" "$OUT/sass.csv.gz" | tee -a "$OUT/tree-stalls.txt"
fi
