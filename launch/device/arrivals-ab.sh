#!/usr/bin/env bash
# Served runs with arrivals over time, binary against binary: `serve-phases.sh` for each rate
# of RATES (requests a second; `inf`: all at once) with BINS (name=path ...; default the
# session's build against .device/base), then the device tests of the carried test binaries.
# DATASETS, METHODS, PROMPTS as serve-phases.sh (defaults: few-shot, auto, 192); TESTS= (set
# and empty) skips the tests. Results: $OUT/rate-R.txt per rate, $OUT/tests.txt, and every
# run's report and log in $OUT/all.tgz.
set -uo pipefail
source "$(dirname "$0")/env.sh"
export BINS=${BINS:-base=.device/base new=.device/canopy}
export DATASETS=${DATASETS:-few-shot} METHODS=${METHODS:-auto} PROMPTS=${PROMPTS:-192}
for r in ${RATES:-40 inf}; do
  RATE=$r OUT=$OUT/rate-$r bash "$(dirname "$0")/serve-phases.sh" > /dev/null
  cp "$OUT/rate-$r/serve-phases.txt" "$OUT/rate-$r.txt"
done
[ -n "${TESTS-1}" ] && device_tests
tar czf "$OUT/all.tgz" -C "$OUT" $(cd "$OUT" && ls -d rate-*/) && rm -rf "$OUT"/rate-*/
