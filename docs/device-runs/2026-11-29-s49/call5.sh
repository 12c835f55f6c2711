#!/usr/bin/env bash
# Session 49, call 5 (one H200): Nsight Compute on gemv_swiglu (the 8B gate|up, 1 row) of the
# crate's gemv.cu (base) and the bulk-copy ring (bulk, 3 stages), k split over 1 and 8 warps.
set -uo pipefail
source launch/device/env.sh
KERNELS=crates/canopy-kernels/cuda
DEFS=(-DCANOPY_DTYPE=2 $(grep -oP 'pub const \K(\w+): \w+ = \d+(?=;)' crates/canopy-kernels/src/constants.rs \
  | sed -E 's/^(\w+): \w+ = ([0-9]+)$/-D\1=\2/'))
NCU=/usr/local/cuda/bin/ncu
for name in base bulk3; do
  nvcc -O3 -std=c++17 -arch=sm_90a -lineinfo "${DEFS[@]}" -I".device/variants/$name" -I"$KERNELS" \
    launch/device/tools/gemv_bench.cu -o "/tmp/gb-$name" 2>/dev/null || echo "BUILD FAILED $name"
  for s in 1 8; do
    echo "=== $name slices $s"
    $NCU --clock-control none -k regex:gemv_swiglu -s 20 -c 1 --section SpeedOfLight --section Occupancy \
      --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --section LaunchStats \
      "/tmp/gb-$name" 5 1 "$s" 2>&1 | grep -v "^==PROF==" | tail -120
  done
done 2>&1 | tee "$OUT/ncu-gemv.txt"
