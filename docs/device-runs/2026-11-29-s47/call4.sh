#!/usr/bin/env bash
# Session 47, call 4 (one H200): the dense GEMMs at 256, 2,048 and 8,192 rows, default against
# cuBLASLt's offered algorithms, twice.
set -uo pipefail
for r in 1 2; do ITERS=30 ROWS=256,2048,8192 bash launch/device/lt-bench.sh 2>&1 | grep -v "^NVIDIA"; done
