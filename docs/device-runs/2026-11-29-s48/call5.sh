#!/usr/bin/env bash
# Session 48, call 5 (one H200): (1) gemv-bench at 1 row, every split of k, for the crate's
# gemv.cu (base), gemv_swiglu bounded to 64 registers (lb4: 4 CTAs an SM) and three blocks in
# flight bounded to 3 CTAs an SM (u3b3), variants/lb4.patch and u3b3.patch; (2) call 4's per-step
# log at n = 3 and 4 (GEMV at 2-8 rows, max8, against cuBLAS, max1).
set -uo pipefail
source launch/device/env.sh
ROWS=1 SLICES=1,2,4,8 ROUNDS=2 bash launch/device/gemv-bench.sh 2>&1 | grep -E "^(==|qkv|o |gate|down)"
mkdir -p /tmp/b-max8 /tmp/b-max1; cp .device/canopy /tmp/b-max8/canopy; cp .device/canopy-max1 /tmp/b-max1/canopy
for n in 3 4; do
  for side in max8 max1; do
    RUST_LOG=canopy_runtime=debug CANOPY_KERNEL_CACHE=/tmp/kc-$side timeout 90 /tmp/b-$side/canopy generate --arch llama-3.1-8b \
      --random-weights --context-fill random --context 4K --n $n --max-tokens 96 > /dev/null 2> $OUT/log-$side-$n.txt
    echo "== $side n=$n: $(grep -o 'decode [0-9.]* ms/token' $OUT/log-$side-$n.txt)"
    python3 launch/device/tools/steps.py $OUT/log-$side-$n.txt
  done
done
cd $OUT && tar czf logs.tgz log-* && rm -f log-*
