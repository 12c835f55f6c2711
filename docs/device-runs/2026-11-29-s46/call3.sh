#!/usr/bin/env bash
# Session 46, call 3 (one H200): MMA descriptors made once a stage and stepped per MMA
# (desc_plus, in decode_mma.cu and prefill.cu: variants/new) against the lazy rescale alone
# (variants/lazy: 74558d3's decode_mma.cu and prefill.cu with the lazy mma.cuh), as kernel-source
# variants of one binary: device tests on the new build, each variant's SASS instruction mix
# (the count stops at 4096 instructions: the grep matches four-digit addresses), ab-tree on the
# serving trees and FastTree 4 and 6 (checked), the 8B prefill at 32K and 127K alternating.
set -uo pipefail
source launch/device/env.sh
export OUT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
device_tests
for side in lazy new; do
  CANOPY_KERNEL_SOURCES=.device/variants/$side CANOPY_KERNEL_CACHE=/tmp/kc-$side $BIN compile-kernels > /dev/null 2>&1
  for fun in prefill_attention decode_partial_mma; do
    for cubin in $(grep -l "$fun" /tmp/kc-$side/* 2>/dev/null | head -40); do
      n=$(cuobjdump -sass -fun $fun "$cubin" 2>/dev/null | grep -cE "^\s+/\*[0-9a-f]{4}\*/")
      [ "$n" -gt 0 ] || continue
      u=$(cuobjdump -sass -fun $fun "$cubin" | grep -cE "^\s+/\*[0-9a-f]{4}\*/\s+(@\S+\s+)?(U[A-Z0-9]+|R2UR)")
      h=$(cuobjdump -sass -fun $fun "$cubin" | grep -c "HGMMA")
      echo "$side $fun $(basename $cubin) instructions $n uniform $u hgmma $h"
    done
  done
done 2>&1 | tee "$OUT/sass-counts.txt"
tree_toml shared "1, 64" "4096, 16"
A_ENV="CANOPY_KERNEL_SOURCES=.device/variants/lazy CANOPY_KERNEL_CACHE=/tmp/kc-lazy" \
B_ENV="CANOPY_KERNEL_SOURCES=.device/variants/new CANOPY_KERNEL_CACHE=/tmp/kc-new" \
TREES="/tmp/shared.toml configs/workloads/serve-few-shot.toml configs/workloads/serve-system-prompt.toml configs/workloads/serve-multi-doc.toml configs/workloads/serve-multi-chain.toml 4 6" \
HEADS=8 METHODS=auto CHECK=true ROUNDS=2 timeout 240 bash launch/device/ab-tree.sh > /dev/null 2>&1
echo "ab-tree rc $?" >> "$OUT/ab-log.txt"
summ() { python3 -c 'import json,sys
r=json.load(open(sys.argv[1]))
for x in r["rows"]: print(sys.argv[2], x["context"], "fill_s %.4f" % x["fill_s"], "tflops %.0f" % x["prefill_tflops_per_device"])' "$1" "$2"; }
for round in 1 2; do
  for side in lazy new; do
    [ $SECONDS -gt 500 ] && { echo "SKIPPED prefill $side $round" | tee -a "$OUT/prefill.txt"; continue; }
    CANOPY_KERNEL_SOURCES=.device/variants/$side CANOPY_KERNEL_CACHE=/tmp/kc-$side $BIN bench decode \
      --arch llama-3.1-8b --random-weights --context 32K,127K --ranks 1 --strategy tree --decode 3 --json \
      > "$OUT/prefill-$side-$round.json" 2> "$OUT/prefill-$side-$round.err"
    summ "$OUT/prefill-$side-$round.json" "prefill $side r$round" | tee -a "$OUT/prefill.txt"
  done
done
cd "$OUT" && tar czf all.tgz *.txt *.json *.err ab.tgz 2>/dev/null && rm -f *.json *.err ab.tgz
