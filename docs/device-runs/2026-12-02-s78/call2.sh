#!/usr/bin/env bash
# Call 2: the thread transport's all-reduce by shares on the device machine's 16 cores:
# `generate` on the CPU (SmolLM2's shape, random weights, a 2,048-token stand-in prompt, 16
# tokens) at 16 and 128 thread ranks, the build of c0daba2 (every rank folding every rank's
# copy under its lock) and the session's build, in turn, two rounds.
set -uo pipefail
rm -f .device/canopy .device/canopy-before
source launch/device/env.sh
for round in 1 2; do
  for bin in before new; do
    b=.device/canopy; [ $bin = before ] && b=.device/canopy-before
    for ranks in 16 128; do
      echo "== round $round, $bin, $ranks thread ranks"
      /usr/bin/time -f "wall %e s, max RSS %M KB" timeout 100 $b generate --backend cpu \
        --arch smollm2-135m --random-weights --context 2048 --max-tokens 16 --ranks $ranks \
        2>&1 | grep -E "prefill|wall|error" | tail -2
    done
  done
done 2>&1 | tee "$OUT/ranks.txt"
