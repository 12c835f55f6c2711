#!/usr/bin/env bash
# Session 49, call 8 (one H200): the committed gemv_bench.cu (normed gate|up timed; no variant
# hooks) built and run on the crate's gemv.cu at the backend's splits, 1 and 2 rows.
set -uo pipefail
ROWS="1 2" ROUNDS=1 ITERS=200 bash launch/device/gemv-bench.sh 2>&1 | grep -Ev "^$|warning|declared but never|^ *\^|^$|Remark"
