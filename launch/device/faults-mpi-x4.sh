#!/usr/bin/env bash
# Issue 4 on nvidia-h200-x4: (1) the watchdog: one rank stops before its first step
# (--stall-rank) and the others must fail within --timeout, naming the rank and the NCCL call,
# as 4 threads and as 4 mpirun processes; (2) `bench scaling` at p = 4 under mpirun (one
# process per GPU), every collective, to compare with the threads run. The carried binary must
# be built with `--features mpi`. Same set-up as kernel.sh.
set -uo pipefail
source "$(dirname "$0")/env.sh"
MPIRUN=(mpirun --allow-run-as-root -np 4 -x NCCL_NVLS_ENABLE -x LD_LIBRARY_PATH -x CANOPY_KERNEL_CACHE)
stall=(bench attention --backend cuda --strategy tree --collective allreduce2 --seq-len 131072 --stall-rank 2 --timeout 5)
{
  echo "== watchdog, 4 threads, rank 2 stalls, timeout 5 s"
  t0=$(date +%s%N); timeout 60 $BIN "${stall[@]}" --ranks 4; rc=$?
  echo "exit $rc after $(( ($(date +%s%N) - t0) / 1000000 )) ms"
  echo "== watchdog, mpirun -np 4, rank 2 stalls, timeout 5 s"
  t0=$(date +%s%N); timeout 60 "${MPIRUN[@]}" $BIN "${stall[@]}" --launcher mpi; rc=$?
  echo "exit $rc after $(( ($(date +%s%N) - t0) / 1000000 )) ms"
  [ "${FAULTS_ONLY:-0}" = 1 ] && exit 0
  echo "== scaling p=4 under mpirun"
  timeout 300 "${MPIRUN[@]}" $BIN bench scaling --backend cuda --launcher mpi --ranks 4 \
    --seq-lens 131072,1048576 --virtual-nodes 2 --iters 20 --json > "$OUT/scaling-mpi.json"
  echo "exit $?"
} 2>&1 | tee "$OUT/log.txt"
