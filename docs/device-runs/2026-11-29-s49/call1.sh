#!/usr/bin/env bash
# Session 49, call 1 (one H200): gemv-bench at 1 row, every split of k, for the crate's gemv.cu
# (base) and session 48's untried variants whose weight TMA bulk copies stream into a per-warp
# mbarrier ring of 4 or 3 stages (bulk4, bulk3). The variants did not build: mma.cuh defines
# its barrier helpers only for the warpgroup path. Only base ran (call1/gemv-bench.txt).
set -uo pipefail
ROWS=1 SLICES=1,2,4,8 ROUNDS=1 ITERS=200 bash launch/device/gemv-bench.sh 2>&1 | grep -Ev "^$|warning|declared but never|^ *\^|^$|Remark"
