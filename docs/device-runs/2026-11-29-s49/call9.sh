#!/usr/bin/env bash
# Session 49, call 9 (one H200), build of 4a65328: the attention's launch and its merge inside
# traced passes (CUPTI), read by attn_tail.py: how long the merge runs past the attention, per
# layer. (1) batch-timeline.sh: generate --n 64 over a random 4K prompt, 8B shape; (2)
# decode-timeline.sh with RUN=generate at 32K and 8K, batch 1.
set -uo pipefail
source launch/device/env.sh
{
  OUT=$OUT/batch timeout 300 bash launch/device/batch-timeline.sh > /dev/null 2>&1; echo "batch exit $?"
  grep -A16 "GPU time by name" $OUT/batch/batch-steps.txt
  python3 docs/device-runs/2026-11-29-s49/call9/attn_tail.py /tmp/batch.tsv 256
  for ctx in 32K 8K; do
    OUT=$OUT/d$ctx RUN=generate CONTEXT=$ctx DECODE=40 timeout 200 bash launch/device/decode-timeline.sh > /dev/null 2>&1
    echo "decode $ctx exit $?"; grep -A12 "GPU time by name" $OUT/d$ctx/steps-new.txt
    python3 docs/device-runs/2026-11-29-s49/call9/attn_tail.py /tmp/steps-new.tsv 320
  done
} 2>&1 | tee $OUT/attn-tail.txt
