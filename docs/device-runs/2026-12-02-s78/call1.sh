#!/usr/bin/env bash
# Call 1: sampling-check.sh on the build of the session's code (the CPU's per-rank pricing,
# the thread transport's all-reduce by shares, the CLI's notes of unused options), then the
# thread transport on the device machine's 16 cores: `generate` on the CPU at 16 and 128
# thread ranks (call 2 runs the build before the all-reduce change beside it).
set -uo pipefail
rm -f .device/canopy .device/layer_ops .device/attention_blocks \
  .device/graph_epoch .device/weight_upload .device/logit_ops .device/product_tuning \
  .device/cuda_graphs
source launch/device/env.sh
DEADLINE=330 OUT=$OUT bash launch/device/sampling-check.sh > /dev/null 2>&1
grep -E "test result|panicked|ALL PASS|FAIL|^== |completed" "$OUT/check.txt"
for ranks in 16 128; do
  echo "== $ranks thread ranks"
  /usr/bin/time -f "wall %e s, max RSS %M KB" timeout 120 .device/canopy generate --backend cpu \
    --arch smollm2-135m --random-weights --context 2048 --max-tokens 16 --ranks $ranks \
    2>&1 | grep -E "prefill|wall|error" | tail -2
done 2>&1 | tee "$OUT/ranks.txt"
