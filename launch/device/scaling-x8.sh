#!/usr/bin/env bash
# Issue 6 on nvidia-h200-x8 (one DGX-class node): `canopy bench scaling` over p = 1, 2, 4, 8 and
# N = 128K … 4M and 5.12M, for 16 heads x 128 and the Llama-3.1-8B shape (32 q / 8 kv x 128),
# bf16, every tree collective (hierarchical over 2 virtual nodes of 4) and the ring: first one
# process with one thread per GPU, then the same under `mpirun -np 8` (one process per GPU).
# Errors against the f64 oracle up to N = 1M. JSON and CSV per shape and launcher; plots are
# drawn off the device (`canopy bench scaling --from F.json --plot F.png`). Each threads run is
# followed by the model fitted on its p <= 4 rows beside its p = 8 rows (`--predict 8`). Not yet
# run: the x8 kind has not been lent (docs/BENCHMARKS.md).
set -uo pipefail
source "$(dirname "$0")/env.sh"
SEQ=${SEQ:-131072,524288,1048576,4194304,5242880}
run() {  # name, extra arguments
  local name=$1; shift
  timeout ${LIMIT:-560} "$@" --seq-lens $SEQ --virtual-nodes 2 --iters ${ITERS:-20} \
    --check-max-tokens 1048576 --csv "$OUT/$name.csv" --json > "$OUT/$name.json"
  echo "$name: exit $?"
}
{
  nvidia-smi topo -m
  for shape in ${SHAPES:-mha llama}; do
    case $shape in
      mha) heads="--heads 16 --kv-heads 16 --head-dim 128" ;;
      llama) heads="--heads 32 --kv-heads 8 --head-dim 128" ;;
    esac
    [ "${LAUNCHERS:-threads mpi}" != mpi ] && run "scaling_${shape}_threads" \
      $BIN bench scaling --backend cuda --ranks 1,2,4,8 $heads --dtype bf16 &&
      $BIN bench scaling --from "$OUT/scaling_${shape}_threads.json" --predict 8 --virtual-nodes 2
    [ "${LAUNCHERS:-threads mpi}" != threads ] && run "scaling_${shape}_mpi" \
      mpirun --allow-run-as-root -np 8 -x NCCL_NVLS_ENABLE -x LD_LIBRARY_PATH -x CANOPY_KERNEL_CACHE \
      $BIN bench scaling --backend cuda --launcher mpi --ranks 8 $heads --dtype bf16
  done
} 2>&1 | tee "$OUT/log.txt"
