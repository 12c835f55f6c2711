#!/usr/bin/env bash
# Issue 4 and 6 on nvidia-h200-x4: `canopy bench scaling` over p = 1, 2, 4 and N = 128K … 4M,
# bf16, every tree collective (hierarchical over 2 virtual nodes where p is even; auto
# calibrated per run) and the ring, one process with one thread per GPU. SHAPES picks mha (16
# heads x 128, issue 4's run) and/or llama (32 q / 8 kv x 128). Errors against the f64 oracle
# up to N = 1M. Writes scaling[_llama].json and .csv; the 8-GPU prediction and the plots are
# made from the JSON off the device (`canopy bench scaling --from F.json --predict 8`).
set -uo pipefail
source "$(dirname "$0")/env.sh"
{
  echo "== copy bandwidth and small all-reduce latency (the floors)"
  timeout 60 $BIN bench kernel --seq-lens 1048576 --check false | tail -4
  for shape in ${SHAPES:-mha}; do
    case $shape in
      mha) heads="--heads 16 --kv-heads 16 --head-dim 128" name=scaling ;;
      llama) heads="--heads 32 --kv-heads 8 --head-dim 128" name=scaling_llama ;;
    esac
    echo "== scaling, threads, $shape"
    timeout ${LIMIT:-480} $BIN bench scaling --backend cuda --ranks 1,2,4 $heads --dtype bf16 \
      --seq-lens 131072,524288,1048576,4194304 --virtual-nodes 2 --iters 20 \
      --check-max-tokens 1048576 --csv "$OUT/$name.csv" --json > "$OUT/$name.json"
    echo "exit $?"
    $BIN bench scaling --from "$OUT/$name.json" --predict 8 --virtual-nodes 2 \
      --seq-lens 2097152,5242880
  done
} 2>&1 | tee "$OUT/log.txt"
