#!/usr/bin/env bash
# Slurm: one canopy process per task, e.g. inside an allocation of N tasks:
#   launch/srun.sh bench attention --backend cuda --seq-len 1048576
# Same build and scope as launch/mpirun.sh (Open MPI built with PMIx/Slurm support).
set -euo pipefail
export NCCL_NVLS_ENABLE=0
exec srun --mpi=pmix "${CANOPY_BIN:-target/release/canopy}" "$@" --launcher mpi
