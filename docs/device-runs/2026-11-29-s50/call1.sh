#!/usr/bin/env bash
# Session 50, call 1 (one H200): decode_partial_ws (pairs of 64-row CTAs over the same KV, one
# copying and two computing warpgroups) in the working tree's build (.device/canopy) against
# 6cb2401's (.device/canopy-base). The kernels' compile and decode_partial_ws's resources, the
# conformance suite on one rank (prompt-72 runs pairs), ab-tree on the batch-64 shape, the
# serving trees and FastTree 4 and 6 against the f64 oracle, then the device tests.
set -uo pipefail
source launch/device/env.sh
export OUT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
$BIN compile-kernels 2>&1 | tail -3 | tee "$OUT/compile.txt"
for c in /tmp/canopy-kernels/decode_mma-sm_90a-*.cubin; do
  /usr/local/cuda/bin/cuobjdump -res-usage "$c" 2>/dev/null | grep -A1 "decode_partial" >> "$OUT/compile.txt"
done
timeout 200 $BIN selftest --backend cuda --ranks 1 --cases 1 --kernel mma > "$OUT/selftest-full.txt" 2>&1
echo "selftest rc $?" > "$OUT/selftest.txt"
grep -E "prompt-72|FAIL|passed|failed" "$OUT/selftest-full.txt" | tail -40 >> "$OUT/selftest.txt"
tree_toml shared "1, 64" "4096, 16"
A_BIN=.device/canopy-base B_BIN=.device/canopy \
TREES="/tmp/shared.toml configs/workloads/serve-few-shot.toml configs/workloads/serve-system-prompt.toml configs/workloads/serve-multi-doc.toml configs/workloads/serve-multi-chain.toml 4 6" \
HEADS=8 METHODS=auto,q-guided CHECK=true ROUNDS=2 timeout 240 bash launch/device/ab-tree.sh > /dev/null 2>&1
echo "ab-tree rc $?" >> "$OUT/ab-log.txt"
[ $SECONDS -lt 520 ] && timeout $((580 - SECONDS)) bash -c 'source launch/device/env.sh; device_tests' > /dev/null 2>&1
cd "$OUT" && tar czf all.tgz *.txt ab.tgz 2>/dev/null; ls
