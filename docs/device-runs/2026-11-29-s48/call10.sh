#!/usr/bin/env bash
# Session 48, call 10 (one H200): gemv-bench at 1 row, every split of k, for the crate's gemv.cu
# (base) and the weight streamed through a per-warp ring of cp.async stages in shared memory,
# 4 and 6 stages (ring4, ring6: 3 and 5 blocks in flight a lane, no registers holding them;
# variants/ring.patch is ring6, ring4 the same with GEMV_RING 4). gemv_bench.cu gives a variant
# the dynamic shared memory its GEMV_RING_BYTES asks.
set -uo pipefail
ROWS=1 SLICES=1,2,4,8 ROUNDS=1 ITERS=200 bash launch/device/gemv-bench.sh 2>&1 | grep -Ev "^$|warning|declared but never|^ *\^|^$|Remark"
