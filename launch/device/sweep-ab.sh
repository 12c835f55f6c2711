#!/usr/bin/env bash
# Issue 25 on fresh draws: `sweep.sh` (every method and `auto`, 40 random trees x 6 head
# configurations, cold L2) for each seed in SEEDS with this build ($BIN) and with BASE, each
# under $OUT/NAME/seedS. Each run's JSON says how `auto`'s pick did against the best method and
# `q-guided` in that same run. LIMIT passes through; NEW_ARGS and BASE_ARGS go to each side's
# `bench tree` (BASE=$BIN NEW_ARGS=--auto-timed: `auto` by the clock against the model, one
# binary). Results: $OUT/sweep-ab.tgz.
set -uo pipefail
HERE=$(dirname "$0")
source "$HERE/env.sh"
for s in ${SEEDS:-4 5}; do
  for entry in "new=$BIN" "base=${BASE:-.device/canopy-base}"; do
    name=${entry%%=*} bin=${entry#*=}
    args=$([ "$name" = new ] && echo "${NEW_ARGS:-}" || echo "${BASE_ARGS:-}")
    OUT=$OUT/$name/seed$s SEED=$s CHECK=false LIMIT=${LIMIT:-42} CANOPY_BIN=$bin \
      TREE_ARGS=$args bash "$HERE/sweep.sh" > /dev/null 2>&1
  done
done
(cd "$OUT" && tar czf sweep-ab.tgz new base && rm -rf new base)
