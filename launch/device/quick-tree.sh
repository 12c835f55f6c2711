#!/usr/bin/env bash
# A sweep of the tensor-core kernel's pipeline over FastTree's trees, cold L2, one line per
# (variant, tree, heads) with each method's median µs. VARIANTS lists TILE:STAGES[:WAVES]
# (WAVES: resident-CTA waves the plan is cut for, default 1); TREES,
# HEADS, METHODS narrow the run; CHECK=true checks every method against the f64 oracle; EXTRA
# adds `bench tree` options (e.g. EXTRA="--kernel mma").
# JSON per run comes back in one archive. Used while tuning; the full run is tree-h100.sh.
set -uo pipefail
source "$(dirname "$0")/env.sh"
{
  for v in ${VARIANTS:-32:4 64:2}; do
    IFS=: read -r tile stages waves <<< "$v"
    waves=${waves:-1}
    for heads in ${HEADS:-8 32}; do
      for t in ${TREES:-0 1 2 3 4 5 6 7 8 9}; do
        f="$OUT/t${tile}s${stages}w${waves}_ft${t}_${heads}.json"
        $BIN bench tree --workload fasttree-$t --heads 32 --kv-heads $heads --head-dim 128 \
          --dtype f16 --method ${METHODS:-deft-node,deft-node-chunk,fasttree} --iterations 20 \
          --mma-tile $tile --mma-stages $stages --waves $waves --check ${CHECK:-false} ${EXTRA:-} --json > "$f" \
          || echo "FAILED: $v ft$t 32/$heads"
        echo "tile $tile stages $stages waves $waves ft$t 32/$heads $(grep -o '"method": "[a-z-]*"\|"median_us": [0-9.]*\|"rel_error": [0-9.e-]*' "$f" | sed 's/"method": //;s/"median_us": //;s/"rel_error": /err /' | paste -sd' ')"
      done
    done
  done
} 2>&1 | tee "$OUT/quick-log.txt"
(cd "$OUT" && tar czf quick.tgz ./*.json && rm -f ./*.json)
