#!/usr/bin/env bash
# What a recorded decode pass's launch costs: tools/graph_launch_bench.cu (built here by nvcc)
# times the host's launch call and the GPU's wait for the first kernel, for graphs shaped like
# a pass (32 layers of KERNELS spinning kernels; plain or programmatic-dependent launches;
# with or without stream-ordered allocations recorded as memory nodes; one graph or cut in
# parts). Then the census of canopy's own recorded passes (`generate` on the 8B shape with
# random weights, at N rows of NS), from the `recorded a decode pass` debug event.
# Results: $OUT/graph-launch.txt.
set -uo pipefail
source "$(dirname "$0")/env.sh"
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  nvcc -O3 -std=c++17 -arch=sm_90a launch/device/tools/graph_launch_bench.cu -o /tmp/graph-launch \
    && timeout 200 /tmp/graph-launch "${KERNELS:-13}" "${ITERS:-30}"
  $BIN compile-kernels > /dev/null 2>&1 || echo "compile-kernels FAILED"
  for n in ${NS:-1 64}; do
    log "generate --n $n: the recorded pass's nodes"
    RUST_LOG=canopy_cuda=debug $BIN generate --arch llama-3.1-8b --random-weights \
      --context-fill random --context 4K --n "$n" --max-tokens 8 2>&1 >/dev/null \
      | sed 's/\x1b\[[0-9;]*m//g' | grep "recorded a decode pass" | head -2
  done
} 2>&1 | tee "$OUT/graph-launch.txt"
