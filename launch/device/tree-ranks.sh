#!/usr/bin/env bash
# Tree KV across ranks on GPUs: `bench tree --ranks P` (one GPU per rank, threads of one
# process, partials merged over NCCL) beside the same tree on one GPU, fp16, head dim 128.
# TREES, HEADS, RANKS and METHODS narrow the run; each run is checked against the f64 oracle.
set -uo pipefail
source "$(dirname "$0")/env.sh"
{
  nvidia-smi --query-gpu=name,memory.total --format=csv
  for heads in ${HEADS:-8}; do
    for t in ${TREES:-4 7 9}; do
      for p in ${RANKS:-1 2}; do
        echo "== fasttree-$t 32/$heads, $p rank(s)"
        $BIN bench tree --workload fasttree-$t --heads 32 --kv-heads $heads --head-dim 128 \
          --dtype f16 --ranks $p --method ${METHODS:-q-guided,deft-node,fasttree} \
          --iterations ${ITER:-20} --json > "$OUT/ft${t}_32_${heads}_p$p.json"
        grep -o '"method": "[a-z-]*"\|"median_us": [0-9.]*\|"rel_error": [0-9.e-]*' \
          "$OUT/ft${t}_32_${heads}_p$p.json" | paste -sd' '
      done
    done
  done
} 2>&1 | tee "$OUT/ranks-log.txt"
(cd "$OUT" && tar czf tree-ranks.tgz ./*.json && rm -f ./*.json)
