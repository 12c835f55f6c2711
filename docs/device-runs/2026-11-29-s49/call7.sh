#!/usr/bin/env bash
# Session 49, call 7 (one H200): gemv-bench (now also timing the normed gate|up, gate_up_n) at
# 1 row, every split of k, two rounds: the crate's gemv.cu (base) against CTAs that loop over
# CTA-sized pieces of the matrix in one wave (variants/persist.patch; gemv_bench.cu with
# variants/bench-hooks.patch caps its grid), so a normed GEMV normalises once a CTA.
set -uo pipefail
ROWS=1 SLICES=1,2,4,8 ROUNDS=2 ITERS=200 bash launch/device/gemv-bench.sh 2>&1 | grep -Ev "^$|warning|declared but never|^ *\^|^$|Remark"
