#!/usr/bin/env bash
# Session 47, call 5 (one H200): the warpgroup decode path with one CTA barrier a tile
# (variants/one-barrier.patch, also the binary's embedded source) against two (variants/base,
# 2cd5ceb's): the conformance suite on the new source (cut off by its timeout: no output),
# ab-tree on the serving trees, `shared` and FastTree 4 and 6 (checked, 3 rounds), then the
# batch-64 pass traced with each.
set -uo pipefail
source launch/device/env.sh
export OUT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 200 $BIN selftest --backend cuda --ranks 1,2 --cases 1 --kernel mma 2>&1 | tail -3 | tee "$OUT/selftest.txt"
tree_toml shared "1, 64" "4096, 16"
A_ENV="CANOPY_KERNEL_SOURCES=.device/variants/base CANOPY_KERNEL_CACHE=/tmp/kc-base" \
B_ENV="CANOPY_KERNEL_SOURCES=.device/variants/new CANOPY_KERNEL_CACHE=/tmp/kc-new" \
TREES="/tmp/shared.toml configs/workloads/serve-few-shot.toml configs/workloads/serve-system-prompt.toml configs/workloads/serve-multi-doc.toml configs/workloads/serve-multi-chain.toml 4 6" \
HEADS=8 METHODS=auto CHECK=true ROUNDS=3 timeout 260 bash launch/device/ab-tree.sh > /dev/null 2>&1
echo "ab-tree rc $?" >> "$OUT/ab-log.txt"
for side in base new; do
  mkdir -p $OUT/tl-$side
  CANOPY_KERNEL_SOURCES=.device/variants/$side CANOPY_KERNEL_CACHE=/tmp/kc-$side OUT=$OUT/tl-$side timeout 100 bash launch/device/batch-timeline.sh > /dev/null 2>&1
  echo "== $side"; sed -n 5p $OUT/tl-$side/batch-steps.txt; grep -E "decode_partial_mma|merge_partials" $OUT/tl-$side/batch-steps.txt | head -2
done 2>&1 | tee "$OUT/timeline.txt"
cat "$OUT/ab-log.txt"
cd "$OUT" && tar czf all.tgz *.txt ab.tgz tl-* 2>/dev/null && rm -rf ab.tgz tl-*
