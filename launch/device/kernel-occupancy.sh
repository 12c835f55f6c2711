#!/usr/bin/env bash
# Occupancy experiment for the one-row decode kernel: as many CTAs per SM as fit (5 at 96
# registers) against 4, at the lengths where fixed costs show. Same set-up as kernel.sh.
set -uo pipefail
source "$(dirname "$0")/env.sh"
{
  for round in 1 2; do
    for cap in 5 4; do
      echo "== round $round, at most $cap CTAs per SM"
      $BIN bench kernel --heads 16 --kv-heads 16 --head-dim 128 --dtype bf16 --seq-lens 131072,524288,1048576 \
        --ctas-per-sm $cap --check false --iters 100 --json-out "$OUT/occupancy_${round}_${cap}.json"
    done
  done
} 2>&1 | tee "$OUT/log.txt"
