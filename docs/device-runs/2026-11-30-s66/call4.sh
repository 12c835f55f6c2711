#!/usr/bin/env bash
# Call 4: the session's build (`new`, 868ea17) against session 65's last (`base`, 8c980cd):
# few-shot served all at once and at 40 a second (arrivals-ab.sh, 192 requests), two rounds
# with the order swapped; then sampling-check.sh on `new`.
set -uo pipefail
source launch/device/env.sh
DEADLINE=580
{
  log "served, base first"
  RATES="inf 40" TESTS= OUT=$OUT/r1 BINS="base=.device/base new=.device/canopy" bash launch/device/arrivals-ab.sh
  grep -E "^==|tokens/s|decode steps" "$OUT/r1/rate-inf.txt" "$OUT/r1/rate-40.txt"
  log "served, new first"
  RATES="inf 40" TESTS= OUT=$OUT/r2 BINS="new=.device/canopy base=.device/base" bash launch/device/arrivals-ab.sh
  grep -E "^==|tokens/s|decode steps" "$OUT/r2/rate-inf.txt" "$OUT/r2/rate-40.txt"
  log "sampling-check"
  DEADLINE=$((DEADLINE - SECONDS)) OUT=$OUT/check bash launch/device/sampling-check.sh > /dev/null 2>&1
  tail -25 "$OUT/check/check.txt"
  log "done"
  cd "$OUT" && tar czf runs.tgz r1 r2 check && rm -rf r1 r2 check
} 2>&1 | tee "$OUT/call4.txt"
