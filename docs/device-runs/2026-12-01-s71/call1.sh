#!/usr/bin/env bash
# Call 1: the CPU backend on the device machine's 16 cores (no GPU used), two builds: `base`
# (the build of 9f76881: the CPU decode kernel a task per group) and `new` (2a21d18: each KV head and
# piece of 512 tokens of a group a task of its own; f32 K and V read where they lie).
# SmolLM2's shape with random weights: `bench decode` with a random context of 2K, 8K and 32K
# (decode only), then `bench serve` on random prompts and on few-shot (one long prompt shared).
set -uo pipefail
source launch/device/env.sh
{
  nproc
  for round in 1 2; do
    for b in base new; do
      log "round $round, $b: bench decode"
      .device/$b bench decode --arch smollm2-135m --random-weights --backend cpu \
        --context 2K,8K,32K --context-fill random --decode 24 2>&1 | grep -E "^context|^ *[0-9]+K? "
    done
  done
  for round in 1 2; do
    for b in base new; do
      log "round $round, $b: bench serve random"
      .device/$b bench serve --arch smollm2-135m --random-weights --backend cpu --dataset random \
        --input-len 64 --num-prompts 32 --max-concurrency 8 --output-len 32 --request-rate inf \
        2>&1 | grep -E "output tokens/s|TPOT|decode passes:"
      log "round $round, $b: bench serve few-shot"
      .device/$b bench serve --arch smollm2-135m --random-weights --backend cpu --dataset few-shot \
        --num-prompts 32 --max-concurrency 16 --output-len 32 --request-rate inf \
        2>&1 | grep -E "output tokens/s|TPOT|decode passes:|hit rate"
    done
  done
  log "done"
} 2>&1 | tee "$OUT/call1.txt"
