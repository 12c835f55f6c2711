#!/usr/bin/env bash
# Call 3: sampling-check.sh on the build of 8bbc99e (the CPU decode attention by pieces of
# tokens over every KV head, the server's shutdown and input fixes, the requests' size checks).
# The device tests and the request-field and logprob checks hold the GPU to the CPU, whose
# attention changed.
set -uo pipefail
rm -f .device/canopy .device/layer_ops .device/attention_blocks .device/graph_epoch \
  .device/weight_upload .device/logit_ops .device/product_tuning .device/cuda_graphs
source launch/device/env.sh
DEADLINE=330 OUT=$OUT bash launch/device/sampling-check.sh > /dev/null 2>&1
grep -E "test result|panicked|ALL PASS|FAIL|^== |completed" "$OUT/check.txt"
