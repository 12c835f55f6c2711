#!/usr/bin/env bash
# Issue 25's random-tree sweep: `bench tree --sweep` over 40 draws of seed 1 (canopy_core::
# random_trees), every method and `auto` on each, one JSON per head configuration so that a
# configuration cut off by its time limit leaves the others. The first configuration is
# checked against the f64 oracle on the host (about a minute for 13.5M query-context tokens
# on 16 cores; CHECK=false times it only); the others time only. DRAWS, SEED, CHECKED, TIMED
# and LIMIT narrow the run; TREE_ARGS go to every `bench tree` (e.g. --auto-timed).
set -uo pipefail
source "$(dirname "$0")/env.sh"
draws=${DRAWS:-40}
seed=${SEED:-1}
run() { # heads check limit
  timeout "$3" $BIN bench tree --sweep "$draws" --seed "$seed" --heads-configs "$1" \
    --backend cuda --check "$2" --iterations 20 ${TREE_ARGS:-} --json \
    > "$OUT/sweep-${1//\//-}.json" \
    || echo "FAILED or cut off: $1 (check $2)"
}
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  run "${CHECKED:-32/8x128}" "${CHECK:-true}" 170
  for h in ${TIMED:-32/32x128 32/4x128 16/1x128 64/8x128 32/8x64}; do
    run "$h" false "${LIMIT:-45}"
  done
  ls -l "$OUT"
} 2>&1 | tee "$OUT/sweep-log.txt"
