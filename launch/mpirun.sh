#!/usr/bin/env bash
# One canopy process per rank under Open MPI, on one node or on the nodes of a hostfile:
#   launch/mpirun.sh NP [HOSTFILE] -- canopy arguments…
# e.g. launch/mpirun.sh 4 -- bench attention --backend cuda --seq-len 1048576
# The binary must be built with `cargo build --release -p canopy-cli --features mpi`; it sees
# that mpirun started it and runs one rank per process (`--launcher mpi`, the default under
# mpirun). `generate`, `serve` and `bench attention`, `scaling` and `decode` run this way; the
# other commands refuse.
# Ranks agree on their configuration at start (a hash exchanged over MPI). With --backend cuda
# each process drives the GPU of its node-local rank and the ranks talk NCCL; on the CPU they
# talk MPI, and a rank that dies ends the job.
#
# Open MPI starts at most one rank per core of a node. Without a hostfile and outside a Slurm
# or PBS allocation the job runs on this node alone, so NP above its core count (a CPU run of 4
# ranks on a 2-core machine) gets --oversubscribe, with a note on stderr. A hostfile or an
# allocation keeps Open MPI's limit: too many ranks for its slots fail rather than share cores.
set -euo pipefail
usage="usage: launch/mpirun.sh NP [HOSTFILE] -- canopy arguments"
np=${1:?$usage}
case $np in '' | *[!0-9]*) echo "launch/mpirun.sh: NP must be a number of ranks; $usage" >&2; exit 2 ;; esac
shift
hosts=()
if [ "${1:-}" != "--" ] && [ -n "${1:-}" ]; then hosts=(--hostfile "$1"); shift; fi
[ "${1:-}" = "--" ] && shift
root=()
[ "$(id -u)" = 0 ] && root=(--allow-run-as-root)
over=()
if [ ${#hosts[@]} = 0 ] && [ -z "${SLURM_JOB_ID:-}" ] && [ -z "${PBS_NODEFILE:-}" ]; then
  # Open MPI's slots: physical cores (hardware threads do not count), at most the CPUs this
  # process may run on.
  cores=$(nproc)
  physical=$(lscpu -p=socket,core 2>/dev/null | grep -v '^#' | sort -u | wc -l) || physical=0
  [ "$physical" -gt 0 ] && [ "$physical" -lt "$cores" ] && cores=$physical
  if [ "$np" -gt "$cores" ]; then
    echo "launch/mpirun.sh: $np ranks on $cores cores of this node: adding --oversubscribe" >&2
    over=(--oversubscribe)
  fi
fi
# NVLink multicast stays off; the rest is Open MPI's and NCCL's defaults. LD_LIBRARY_PATH (the
# CUDA libraries) goes to every rank where it is set.
env=(-x NCCL_NVLS_ENABLE=0)
[ -n "${LD_LIBRARY_PATH:-}" ] && env+=(-x LD_LIBRARY_PATH)
exec mpirun "${root[@]}" "${over[@]}" "${hosts[@]}" -np "$np" "${env[@]}" \
  "${CANOPY_BIN:-target/release/canopy}" "$@"
