#!/usr/bin/env bash
# Issue 4 on nvidia-h200-x4: `canopy bench scaling` over p = 1, 2, 4 and N = 128K … 4M, 16 heads
# x 128, bf16, every tree collective (hierarchical over 2 virtual nodes where p is even; auto
# calibrated per run) and the ring, one process with one thread per GPU. Errors against the f64
# oracle up to N = 1M. Writes scaling.json and scaling.csv; plots are drawn from the JSON off
# the device (`canopy bench scaling --from scaling.json --plot …`). Same set-up as kernel.sh.
set -uo pipefail
source "$(dirname "$0")/env.sh"
{
  echo "== copy bandwidth and small all-reduce latency (the floors)"
  timeout 60 $BIN bench kernel --seq-lens 1048576 --check false | tail -4
  echo "== scaling, threads"
  timeout 480 $BIN bench scaling --backend cuda --ranks 1,2,4 \
    --seq-lens 131072,524288,1048576,4194304 --virtual-nodes 2 --iters 20 \
    --check-max-tokens 1048576 --csv "$OUT/scaling.csv" --json > "$OUT/scaling.json"
  echo "exit $?"
} 2>&1 | tee "$OUT/log.txt"
