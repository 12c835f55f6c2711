#!/usr/bin/env bash
# Call 4: the CPU backend on the device machine's 16 cores (no GPU used), the session's first
# and last decode kernels: `base` (the build of 9f76881: a task per group, one core a KV head)
# and `final` (4a2ee0e's code: each KV head and piece of 512 tokens a task, a block's products on
# gemm from 16 rows). SmolLM2's shape with random weights: `bench decode` with a random
# context of 2K, 8K and 32K (decode only), then `bench serve` on random prompts and on
# few-shot (one 4K-token prompt shared by every request).
set -uo pipefail
source launch/device/env.sh
{
  nproc
  for round in 1 2; do
    for b in base final; do
      log "round $round, $b: bench decode"
      .device/$b bench decode --arch smollm2-135m --random-weights --backend cpu \
        --context 2K,8K,32K --context-fill random --decode 24 2>&1 | grep -E "^context|^ *[0-9]+K? "
    done
  done
  for b in base final; do
    log "$b: bench serve random"
    .device/$b bench serve --arch smollm2-135m --random-weights --backend cpu --dataset random \
      --input-len 64 --num-prompts 32 --max-concurrency 8 --output-len 32 --request-rate inf \
      2>&1 | grep -E "output tokens/s|TPOT|decode passes:"
    log "$b: bench serve few-shot"
    .device/$b bench serve --arch smollm2-135m --random-weights --backend cpu --dataset few-shot \
      --num-prompts 32 --max-concurrency 16 --output-len 32 --request-rate inf \
      2>&1 | grep -E "output tokens/s|TTFT|TPOT|decode passes:|hit rate"
  done
  log "done"
} 2>&1 | tee "$OUT/call4.txt"
