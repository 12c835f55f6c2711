#!/usr/bin/env bash
# The TMA + warpgroup-MMA prototype of a few-row product (tools/gemm_tma_bench.cu, built here
# with nvcc against the crate's common.cuh and mma.cuh) against cuBLAS, at 64 rows of the 8B
# shape's projections and every k split, for each stage count in STAGES (default "4 6"): alone,
# after a norm kernel, and chained behind it. DEFINES adds nvcc definitions (KB, NO_X, NO_MMA:
# the tool's header says what they do). The shared constants come from canopy-kernels'
# constants.rs, their one source. Results: $OUT/gemm-tma-bench.txt.
set -uo pipefail
source "$(dirname "$0")/env.sh"
KERNELS=crates/canopy-kernels/cuda
DEFS=$(grep -oP 'pub const \K(\w+): \w+ = \d+(?=;)' crates/canopy-kernels/src/constants.rs \
  | sed -E 's/^(\w+): \w+ = ([0-9]+)$/-D\1=\2/')
{
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
  for stages in ${STAGES:-4 6}; do
    echo "== $stages stages"
    nvcc -O3 -std=c++17 -arch=sm_90a -DCANOPY_DTYPE=2 -DHEAD_DIM=128 $DEFS -DTMA_STAGES="$stages" ${DEFINES:-} -I"$KERNELS" \
      launch/device/tools/gemm_tma_bench.cu -lcublas -lcuda -o "/tmp/gemm-tma-$stages" \
      && timeout 120 "/tmp/gemm-tma-$stages" "${ITERS:-100}"
  done
} 2>&1 | tee "$OUT/gemm-tma-bench.txt"
