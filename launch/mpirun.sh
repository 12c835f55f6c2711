#!/usr/bin/env bash
# One canopy process per rank under Open MPI, on one node or on the nodes of a hostfile:
#   launch/mpirun.sh NP [HOSTFILE] -- canopy arguments…
# e.g. launch/mpirun.sh 4 -- bench attention --backend cuda --seq-len 1048576
# The binary must be built with `cargo build --release -p canopy-cli --features mpi`.
# Ranks agree on their configuration at start (a hash exchanged over MPI). With --backend cuda
# each process drives the GPU of its node-local rank and the ranks talk NCCL; on the CPU they
# talk MPI, and a rank that dies ends the job.
set -euo pipefail
np=${1:?usage: launch/mpirun.sh NP [HOSTFILE] -- canopy arguments}
shift
hosts=()
if [ "${1:-}" != "--" ] && [ -n "${1:-}" ]; then hosts=(--hostfile "$1"); shift; fi
[ "${1:-}" = "--" ] && shift
root=()
[ "$(id -u)" = 0 ] && root=(--allow-run-as-root)
# NVLink multicast stays off; the rest is Open MPI's and NCCL's defaults.
exec mpirun "${root[@]}" "${hosts[@]}" -np "$np" -x NCCL_NVLS_ENABLE=0 -x LD_LIBRARY_PATH \
  "${CANOPY_BIN:-target/release/canopy}" "$@" --launcher mpi
