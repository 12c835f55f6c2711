#!/usr/bin/env bash
# Session 49, call 3 (one H200; call 2 was a second failed build): gemv-bench at 1 row, every
# split of k, for the bulk-copy ring with its own barrier helpers (variants/bulk.patch, 3
# stages; bulk4 the same with GEMV_RING 4): lane 0 of each warp issues one bulk copy a weight
# row per run of 2 blocks (256 bytes a row), 2 or 3 runs ahead. gemv_bench.cu carried
# variants/bench-hooks.patch (the ring's dynamic shared memory).
set -uo pipefail
ROWS=1 SLICES=1,2,4,8 ROUNDS=1 ITERS=200 bash launch/device/gemv-bench.sh 2>&1 | grep -Ev "^$|warning|declared but never|^ *\^|^$|Remark"
