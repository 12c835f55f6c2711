#!/usr/bin/env bash
# Quick look at a few FastTree trees (no oracle check unless CHECK=true): WAVES and KERNEL pass
# through to `bench tree`. Used while tuning; the full run is tree-h100.sh.
source "$(dirname "$0")/env.sh"
for tile in ${TILES:-64}; do TILE=$tile; for w in ${WAVES:-1}; do for heads in ${HEADS:-8 32}; do for t in ${TREES:-0 1 4 7 9}; do
  echo "== ft$t 32/$heads waves $w tile $tile"
  $BIN bench tree --workload fasttree-$t --heads 32 --kv-heads $heads --head-dim 128 --dtype f16 \
    --method ${METHODS:-q-guided,deft-node,deft-flatten,fasttree} --iterations 20 --waves $w \
    --kernel ${KERNEL:-auto} --mma-tile ${TILE:-64} --check ${CHECK:-false} | tail -n +4 | awk '{print $1, $(NF-5), $(NF-2), $(NF-1), $NF}'
done; done; done; done
