#!/usr/bin/env bash
# Session 49, call 4 (one H200): call4/bulk_stream.cu, a 235 MB weight (the 8B gate|up) streamed
# by cp.async.bulk copies of 256 B-4 KB (one a row, 16 rows a warp a stage) through per-warp
# mbarrier rings of 2-6 stages, no compute, lane 0 or lanes 0-15 issuing, against a plain
# ld.global.v4 stream: does the copy size bound a bulk-fed GEMV?
set -uo pipefail
source launch/device/env.sh
nvcc -O3 -std=c++17 -arch=sm_90a docs/device-runs/2026-11-29-s49/call4/bulk_stream.cu -o /tmp/bulk_stream \
  && /tmp/bulk_stream 2>&1 | tee $OUT/bulk-stream.txt
