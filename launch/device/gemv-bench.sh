#!/usr/bin/env bash
# The decode GEMVs timed alone (tools/gemv_bench.cu, built here with nvcc) for every variant
# folder under $VARIANTS (default .device/variants, as kernel-variants.sh: each holds
# replacement sources, layers.cu, gemv.cu and/or common.cuh; an empty one, or none at all, is
# the crate's), ROUNDS rounds in turn, at each of ROWS (a list) activation rows, with each of
# SLICES (comma-separated warps per column group; unset: the backend's choice).
# The shared constants come from canopy-kernels' constants.rs, their one source.
# Results: $OUT/gemv-bench.txt.
set -uo pipefail
source "$(dirname "$0")/env.sh"
VARIANTS=${VARIANTS:-.device/variants}
KERNELS=crates/canopy-kernels/cuda
DEFS=(-DCANOPY_DTYPE=2 $(grep -oP 'pub const \K(\w+): \w+ = \d+(?=;)' crates/canopy-kernels/src/constants.rs \
  | sed -E 's/^(\w+): \w+ = ([0-9]+)$/-D\1=\2/'))
{
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
  names=()
  mkdir -p /tmp/gemv-bench
  for dir in "$VARIANTS"/*/; do [ -d "$dir" ] && names+=("$(basename "$dir")"); done
  [ ${#names[@]} -gt 0 ] || names=(crate)  # no variants: the crate's sources alone
  for name in "${names[@]}"; do
    nvcc -O3 -std=c++17 -arch=sm_90a "${DEFS[@]}" -I"$VARIANTS/$name" -I"$KERNELS" \
      launch/device/tools/gemv_bench.cu -o "/tmp/gemv-bench/$name" || echo "BUILD FAILED $name"
  done
  for round in $(seq "${ROUNDS:-2}"); do
    for name in "${names[@]}"; do
      echo "== $name, round $round"
      for rows in ${ROWS:-1}; do
        "/tmp/gemv-bench/$name" "${ITERS:-200}" "$rows" ${SLICES:+"$SLICES"}
      done
    done
  done
} 2>&1 | tee "$OUT/gemv-bench.txt"
