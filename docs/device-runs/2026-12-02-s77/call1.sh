#!/usr/bin/env bash
# Call 1: the CPU's decode attention on the device machine's 16 cores, `base` (f5dad12) against
# `new` (the working tree of a7b3d45+: a piece of a group covers every KV head of its tokens, so
# a task reads whole token rows) in turn: `bench decode --backend cpu` with random weights and a
# random context, SmolLM2's shape (9/3 heads x 64) and Llama-3.2-1B's (32/8 x 64), three rounds.
set -uo pipefail
source launch/device/env.sh
lscpu | grep -E "Model name|^CPU\(s\)"
for round in 1 2 3; do
  for b in base new; do
    bin=.device/canopy-$b; [ $b = new ] && bin=.device/canopy
    for arch in smollm2-135m llama-3.2-1b; do
      ctx=4K,32K; [ $arch = smollm2-135m ] && ctx=4K,32K,128K
      echo "== round $round, $b, $arch"
      timeout 150 $bin bench decode --arch $arch --random-weights --backend cpu --context $ctx \
        --context-fill random --decode 20 2>&1 | grep -E "^[0-9]+ "
    done
  done
done
