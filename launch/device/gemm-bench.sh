#!/usr/bin/env bash
# The few-row products of gemm.cu timed alone against cuBLAS (tools/gemm_bench.cu, built here
# with nvcc against the crate's sources), at 16, 32 and 64 rows of the 8B shape's
# projections, every cluster split and the host's pick. CONFIGS lists variants to build (see
# below; default: the crate's own); the shared constants come from
# canopy-kernels' constants.rs, their one source. Results: $OUT/gemm-bench.txt. With NCU set,
# Nsight Compute then profiles the first launch of each entry (16 rows, no cluster) of the
# first layout: $OUT/ncu-details.txt, and the SASS source page with its stall samples,
# $OUT/ncu-source.csv.gz.
set -uo pipefail
source "$(dirname "$0")/env.sh"
KERNELS=crates/canopy-kernels/cuda
defines() {
  grep -oP 'pub const \K(\w+): \w+ = \d+(?=;)' crates/canopy-kernels/src/constants.rs \
    | sed -E 's/^(\w+): \w+ = ([0-9]+)$/-D\1=\2/' 
}
{
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
  # A layout: comma-separated NAME=value defines that override the crate's (e.g.
  # GEMM_WARPS_N=2,GEMM_WARPS_K=4,GEMM_STAGES=2); "crate" builds the crate's own.
  i=0
  for config in ${CONFIGS:-crate}; do
    i=$((i + 1))
    extra=()
    [ "$config" != crate ] && IFS=, read -ra extra <<< "$config"
    overridden=$(printf '%s\n' "${extra[@]}" | sed -E 's/=.*//' | paste -sd'|')
    echo "== $config"
    nvcc -O3 -std=c++17 -arch=sm_90a -DCANOPY_DTYPE=2 \
      $(defines | grep -vE "^-D(${overridden:-NONE})=") "${extra[@]/#/-D}" \
      -I"$KERNELS" launch/device/tools/gemm_bench.cu -lcublas -o "/tmp/gemm-bench-$i" \
      && "/tmp/gemm-bench-$i" "${ITERS:-100}"
  done
} 2>&1 | tee "$OUT/gemm-bench.txt"
if [ -n "${NCU:-}" ]; then
  first=$(ls /tmp/gemm-bench-* | head -1)
  ncu --clock-control none --kernel-name regex:gemm_rows --launch-count 3 \
    --section SpeedOfLight --section WarpStateStats --section SourceCounters --section MemoryWorkloadAnalysis \
    --section Occupancy --section LaunchStats -o /tmp/gemm -f "$first" 1 > /dev/null 2>&1
  ncu -i /tmp/gemm.ncu-rep --page details > "$OUT/ncu-details.txt" 2>&1
  ncu -i /tmp/gemm.ncu-rep --page source --csv --print-source sass 2>&1 | gzip > "$OUT/ncu-source.csv.gz"
  grep -E "gemm_rows|Duration|DRAM Throughput|Stall|Warp Cycles|Achieved Occupancy|Issued Warp" "$OUT/ncu-details.txt" | head -60
fi
