#!/usr/bin/env bash
# Issue 4 on nvidia-h200-x4: the same decode step (tree with every collective, and the ring;
# p = 4, N = 1M, 16 heads x 128, bf16) once as 4 threads of one process and once as 4 processes
# under mpirun (one GPU each, NCCL id over MPI), to compare outputs and timings. The carried
# binary must be built with `--features mpi`. Same set-up as kernel.sh.
set -uo pipefail
source "$(dirname "$0")/env.sh"
args=(bench attention --backend cuda --strategy all --seq-len 1048576 --iters 20 --json)
{
  echo "== 4 threads, one process"
  timeout 150 $BIN "${args[@]}" --ranks 4 > "$OUT/threads.json"
  echo "== mpirun -np 4"
  timeout 150 mpirun --allow-run-as-root -np 4 -x NCCL_NVLS_ENABLE -x LD_LIBRARY_PATH -x CANOPY_KERNEL_CACHE \
    $BIN "${args[@]}" --launcher mpi > "$OUT/mpi.json"
  python3 - "$OUT/threads.json" "$OUT/mpi.json" <<'PY'
import json, sys
t, m = (json.load(open(p))["rows"] for p in sys.argv[1:3])
for a, b in zip(t, m):
    print(f"{a['strategy']:16} threads {a['median_ms']:.4f} ms (err {a['rel_error']:.2e})   mpirun {b['median_ms']:.4f} ms (err {b['rel_error']:.2e})   ratio {b['median_ms'] / a['median_ms']:.3f}")
PY
} 2>&1 | tee "$OUT/log.txt"
