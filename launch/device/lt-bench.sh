#!/usr/bin/env bash
# The dense layers' GEMMs at serving's row counts: canopy's cublasGemmEx call against every
# algorithm cuBLASLt's heuristic offers (tools/lt_bench.cu, built here with nvcc), beside the
# weights' floor. ROWS (comma-separated) picks the row counts (e.g. 8192, a prefill chunk's);
# SEARCH=1 also times every configuration of every algorithm cuBLASLt lists (split-K included).
# Results: $OUT/lt-bench.txt.
set -uo pipefail
source "$(dirname "$0")/env.sh"
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  nvcc -O3 -std=c++17 -arch=sm_90a launch/device/tools/lt_bench.cu -lcublas -lcublasLt -o /tmp/lt-bench \
    && /tmp/lt-bench "${ITERS:-50}" ${ROWS:+"$ROWS"}
} 2>&1 | tee "$OUT/lt-bench.txt"
