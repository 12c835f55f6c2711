#!/usr/bin/env bash
# Session 48, call 2 (one H200), feb8360's gemv.cu and gemv-bench (then with `_rows16` builds
# picked past 8 rows): the GEMVs alone at 16 and 8 rows, for each split of k over 1, 2, 4 and
# 8 warps, with the crate's gemv.cu (base) and with one reading the activation as 16-bit
# elements (bf16x, variants/bf16x.patch: timing only, its check reads floats as bf16).
set -uo pipefail
ROWS="16 8" SLICES=1,2,4,8 ROUNDS=2 ITERS=200 bash launch/device/gemv-bench.sh 2>&1 | grep -v "^$"
