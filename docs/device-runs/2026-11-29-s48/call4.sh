#!/usr/bin/env bash
# Session 48, call 4 (one H200), builds of call 3: every decode step of `generate --n N` (8B
# shape, random weights, random 4K prompt, 96 tokens) from the runtime's debug log: replayed or
# not, and its pass time (tools/steps.py), for the GEMV at 2-8 rows (max8) and cuBLAS (max1).
set -uo pipefail
source launch/device/env.sh
mkdir -p /tmp/b-max8 /tmp/b-max1; cp .device/canopy /tmp/b-max8/canopy; cp .device/canopy-max1 /tmp/b-max1/canopy
for n in 2 8; do
  for side in max8 max1; do
    RUST_LOG=canopy_runtime=debug CANOPY_KERNEL_CACHE=/tmp/kc-$side timeout 90 /tmp/b-$side/canopy generate --arch llama-3.1-8b \
      --random-weights --context-fill random --context 4K --n $n --max-tokens 96 > /dev/null 2> $OUT/log-$side-$n.txt
    echo "== $side n=$n: $(grep -o 'decode [0-9.]* ms/token' $OUT/log-$side-$n.txt)"
  done
done
cd $OUT && tar czf logs.tgz log-* && rm -f log-*
