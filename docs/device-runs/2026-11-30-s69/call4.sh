#!/usr/bin/env bash
# Call 4: the session's build (`new`, the page tables' and masks' room) under compute-sanitizer
# (sanitizer.sh: memcheck, racecheck and initcheck on short generations of the tiny models,
# replans rewriting a recorded step's plan in place among them); then `bench decode` at 8K
# and 32K, 8B shape, one round, against 1fed82d (`base`), 150 tokens so that leaves outgrow
# their growth room and replan.
set -uo pipefail
source launch/device/env.sh
{
  log "sanitizer (new)"
  OUT=$OUT/sanitizer bash launch/device/sanitizer.sh > /dev/null 2>&1
  cat "$OUT/sanitizer/sanitizer.txt"
  log "bench decode, 8B, 8K and 32K"
  BINS="new=.device/canopy base=.device/base" ARCHS=llama-3.1-8b ROUNDS=1 DECODE=150 \
    DEADLINE=200 OUT=$OUT/ab bash launch/device/ab-decode.sh > /dev/null 2>&1
  tail -8 "$OUT/ab/log.txt"
  log "done"
} 2>&1 | tee "$OUT/call4.txt"
