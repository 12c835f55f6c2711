#!/usr/bin/env bash
# Session 49, call 6 (one H200): gemv-bench at 1 row, every split of k, two rounds: the crate's
# gemv.cu (base) against the bulk-copy ring whose copies lanes 0-15 issue, one each
# (variants/bulk-lanes.patch: bulk3p, 3 stages; bulk4p, 4).
set -uo pipefail
ROWS=1 SLICES=1,2,4,8 ROUNDS=2 ITERS=200 bash launch/device/gemv-bench.sh 2>&1 | grep -Ev "^$|warning|declared but never|^ *\^|^$|Remark"
