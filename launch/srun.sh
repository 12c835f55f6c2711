#!/usr/bin/env bash
# Slurm: one canopy process per task, e.g. inside an allocation of N tasks:
#   launch/srun.sh bench attention --backend cuda --seq-len 1048576
# Same build and scope as launch/mpirun.sh: the MPI build sees that srun started it and runs
# one rank per task (`--launcher mpi`, the default under srun), for the same commands. Open MPI must be built with PMIx/Slurm support;
# CANOPY_SRUN_MPI picks another plugin of `srun --mpi=list` (default pmix).
# srun starts as many tasks as the allocation has (or its -n); it fails rather than put more
# tasks than CPUs on a node, so nothing here oversubscribes.
set -euo pipefail
export NCCL_NVLS_ENABLE=0
exec srun --mpi="${CANOPY_SRUN_MPI:-pmix}" "${CANOPY_BIN:-target/release/canopy}" "$@"
