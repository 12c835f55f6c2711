#!/usr/bin/env bash
# Where `decode_partial_mma` waits on a serving tree: Nsight Compute's full set for one launch
# of `auto`'s plan (caches flushed, clocks as run), its stall reasons per warp, and the SASS
# with each instruction's stall samples (CSV), for the tree `bench serve`'s few-shot dataset
# makes at 64 in flight (TREE names another of configs/workloads/serve-*.toml). Results:
# $OUT/stalls-TREE.txt (details), $OUT/sass-TREE.csv, $OUT/TREE.ncu-rep.
set -uo pipefail
source "$(dirname "$0")/env.sh"
NCU=${NCU:-/usr/local/cuda/bin/ncu}
TREE=${TREE:-few-shot}
w=configs/workloads/serve-$TREE.toml
$BIN bench tree --workload $w --method auto --iterations 20 --check false 2>&1 | tail -3
$NCU --cache-control all --clock-control none -k regex:decode_partial_mma --launch-skip 3 \
  --launch-count 1 --set full -o "$OUT/$TREE" -f \
  $BIN bench tree --workload $w --method auto --iterations 3 --check false > /dev/null 2>&1
$NCU -i "$OUT/$TREE.ncu-rep" --page details --print-details all > "$OUT/stalls-$TREE.txt" 2>&1
$NCU -i "$OUT/$TREE.ncu-rep" --page source --csv --print-source sass > "$OUT/sass-$TREE.csv" 2>&1
ls -l "$OUT"
grep -i -E "stall|warp cycles|eligible|duration" "$OUT/stalls-$TREE.txt" | head -60
