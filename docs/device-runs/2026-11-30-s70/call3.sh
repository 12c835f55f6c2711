#!/usr/bin/env bash
# Call 3: the CPU backend on the device machine's 16 cores (no GPU used), two builds: `base`
# (f0967bb) and `dot` (the working tree: 838211d's few-row products and blocked prompt
# attention, and the decode attention's dot products in eight partial sums).
# SmolLM2's shape with random weights: `bench decode` at 2K (prefill and decode), then
# `bench serve` (random prompts of 64 tokens, 32 requests, 8 at a time, 32 tokens each).
set -uo pipefail
source launch/device/env.sh
{
  nproc
  for round in 1 2; do
    for b in base dot; do
      log "round $round, $b: bench decode"
      .device/$b bench decode --arch smollm2-135m --random-weights --backend cpu --context 2K \
        --decode 24 2>&1 | grep -E "^context|^[0-9]+ "
    done
  done
  for round in 1 2; do
    for b in base dot; do
      log "round $round, $b: bench serve"
      .device/$b bench serve --arch smollm2-135m --random-weights --backend cpu --dataset random \
        --input-len 64 --num-prompts 32 --max-concurrency 8 --output-len 32 --request-rate inf \
        2>&1 | grep -E "output tokens/s|TPOT|decode passes:"
    done
  done
  log "done"
} 2>&1 | tee "$OUT/call3.txt"
