#!/usr/bin/env bash
# Session 47, call 3 (one H200, d21c590's lt_bench.cu): o and down at 16-128 rows, storing
# (beta 0: o-store, down-store) against adding into the residual, beside cuBLASLt's offered algorithms.
set -uo pipefail
ITERS=100 ROWS=16,32,64,128 bash launch/device/lt-bench.sh 2>&1 | tail -30
