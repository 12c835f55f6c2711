#!/usr/bin/env bash
# Session 46, call 1 (one H200): the lazy rescale (RESCALE_SLACK) in mma.cuh, build of 2ad2833's
# kernels: .device/variants/base/mma.cuh = 74558d3's, .device/variants/new/mma.cuh = the lazy one.
# Device tests on the new build, then ab-tree (base vs new as kernel-source variants of the same
# binary) on the serving trees, the batch-64 shape and FastTree 4 and 6, checked against the f64
# oracle, then the conformance suite on one rank.
set -uo pipefail
source launch/device/env.sh
export OUT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
device_tests
tree_toml shared "1, 64" "4096, 16"
A_ENV="CANOPY_KERNEL_SOURCES=.device/variants/base CANOPY_KERNEL_CACHE=/tmp/kc-base" \
B_ENV="CANOPY_KERNEL_SOURCES=.device/variants/new CANOPY_KERNEL_CACHE=/tmp/kc-new" \
TREES="/tmp/shared.toml configs/workloads/serve-few-shot.toml configs/workloads/serve-system-prompt.toml configs/workloads/serve-multi-doc.toml configs/workloads/serve-multi-chain.toml 4 6" \
HEADS=8 METHODS=auto,q-guided CHECK=true ROUNDS=2 timeout 300 bash launch/device/ab-tree.sh > /dev/null 2>&1
echo "ab-tree rc $?" >> "$OUT/ab-log.txt"
left=$((560 - SECONDS))
echo "selftest budget $left s" > "$OUT/selftest.txt"
timeout $((left > 30 ? left - 10 : 20)) $BIN selftest --backend cuda --ranks 1 --cases 1 --kernel mma 2>&1 | tail -15 >> "$OUT/selftest.txt"
cd "$OUT" && tar czf all.tgz *.txt ab.tgz 2>/dev/null; ls
