#!/usr/bin/env bash
# A build's sampling checked and timed in one call, the parts of PARTS in order (default
# "check walks ab"):
# - check: sampling-check.sh (device tests, served against generate, every field GPU against
#   CPU, model-check, bench serve; DEADLINE 300 s);
# - walks: walks-ab.sh for the carried build (its walks at 64 rows and at one);
# - costs: draw-costs.sh for the carried build (the phases of a served step);
# - ab: sampling-ab.sh (bench serve, base against new, ROUNDS rounds, default 3).
# Every file is archived into $OUT/all.tgz (a call returns few files); the summary lines go to
# stdout.
set -uo pipefail
here=$(dirname "$0")
source "$here/env.sh"
for part in ${PARTS:-check walks ab}; do
  case $part in
    check)
      DEADLINE=300 timeout 330 bash "$here/sampling-check.sh" > "$OUT/check-out.txt" 2>&1
      grep -E "ALL PASS|FAIL|test result" "$OUT/check-out.txt" ;;
    walks)
      BINS="new=$BIN" NS="64 1" timeout 120 bash "$here/walks-ab.sh" > "$OUT/walks-out.txt" 2>&1
      grep -E "^==|walk_|median" "$OUT/walks-out.txt" ;;
    costs)
      timeout 200 bash "$here/draw-costs.sh" > "$OUT/costs-out.txt" 2>&1
      grep -v "^== " "$OUT/costs-out.txt" | grep -v "compile-kernels" ;;
    ab)
      ROUNDS=${ROUNDS:-3} timeout 400 bash "$here/sampling-ab.sh" > "$OUT/ab-out.txt" 2>&1
      grep round "$OUT/ab-out.txt" ;;
  esac
done
(cd "$OUT" && tar czf /tmp/all.tgz . && rm -rf ./* && mv /tmp/all.tgz .)
