#!/usr/bin/env bash
# Session 49, call 10 (one H200): the committed gemv_bench.cu after its mend (the norm weight
# allocated for the normed product only), built and run at the backend's splits, 1 row.
set -uo pipefail
ROWS=1 ROUNDS=1 ITERS=200 bash launch/device/gemv-bench.sh 2>&1 | grep -Ev "^$|warning|declared but never|^ *\^|^$|Remark"
