#!/usr/bin/env bash
# An A/B comparison on FastTree's trees, cold L2: for each (tree, heads) the two sides run one
# after the other, ROUNDS times, alternating, so drift on the machine falls on both. A side is a
# binary (A_BIN, B_BIN; default the carried one) and environment (A_ENV, B_ENV, e.g.
# "CANOPY_X=1"). TREES (FastTree's tree numbers, or workload TOMLs), HEADS, METHODS narrow the
# run; EXTRA adds `bench tree` options. One line
# per run with each method's median µs; compare the minima over rounds (noise on one plan is up
# to 11% between runs: BENCHMARKS, session 10).
set -uo pipefail
source "$(dirname "$0")/env.sh"
A_BIN=${A_BIN:-$BIN}
B_BIN=${B_BIN:-$BIN}
{
  for heads in ${HEADS:-8 32}; do
    for t in ${TREES:-0 1 2 3 4 5 6 7 8 9}; do
      for round in $(seq "${ROUNDS:-2}"); do
        for side in A B; do
          if [ $side = A ]; then bin=$A_BIN; envs=${A_ENV:-}; else bin=$B_BIN; envs=${B_ENV:-}; fi
          w=$t
          [[ $t =~ ^[0-9]+$ ]] && w=fasttree-$t
          name=$(basename "$w" .toml)
          f="$OUT/${side}${round}_${name}_${heads}.json"
          env $envs "$bin" bench tree --workload $w --heads 32 --kv-heads $heads --head-dim 128 \
            --dtype f16 --method ${METHODS:-q-guided,deft-node,deft-node-chunk,fasttree} --iterations 20 \
            --check ${CHECK:-false} ${EXTRA:-} --json > "$f" || echo "FAILED: $side $name 32/$heads"
          echo "$side round $round $name 32/$heads $(grep -o '"method": "[a-z-]*"\|"median_us": [0-9.]*\|"rel_error": [0-9.e-]*' "$f" | sed 's/"method": //;s/"median_us": //;s/"rel_error": /err /' | paste -sd' ')"
        done
      done
    done
  done
} 2>&1 | tee "$OUT/ab-log.txt"
(cd "$OUT" && tar czf ab.tgz ./*.json && rm -f ./*.json)
