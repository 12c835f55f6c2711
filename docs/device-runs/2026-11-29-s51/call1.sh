# Session 51 call 1: the TMA + warpgroup-MMA prototype alone, after a norm kernel, and chained.
ITERS=50 STAGES="4 6" bash launch/device/gemm-tma-bench.sh 2>&1 | tail -60
