#!/usr/bin/env bash
# Session 45, call 6 (one H200), build of 0d632e4: bench decode's floor for ranks that share
# the GPU (1, 2 and 8 ranks as threads; 2 MPI processes), 32K, tree.
set -uo pipefail
source launch/device/env.sh
mkdir -p $OUT/r
show() {
  python3 - "$1" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"copy {r['copy_bandwidth_gb_s']:.0f} GB/s, devices {r['devices']}")
for x in r["rows"]:
    m = x.get("merge_ms_per_layer")
    print(f"{x['context']:>8} P={x['ranks']} per device {x['ranks_per_device']} {x['strategy']:<12} {x['decode_ms_per_token']:8.3f} ms/token "
          f"floor {x['floor_ms']:.3f} x{x['vs_floor']:.3f} merge {'-' if m is None else f'{m*1e3:.1f} us/layer'}")
PY
}
ARGS=(bench decode --arch llama-3.1-8b --random-weights --context-fill random --context 32K --strategy tree --decode 10 --json)
timeout 200 $BIN "${ARGS[@]}" --ranks 1,2,8 > $OUT/r/threads.json 2> $OUT/r/threads.err; echo "threads exit $?"
show $OUT/r/threads.json
timeout 150 mpirun --allow-run-as-root -np 2 -x LD_LIBRARY_PATH -x NCCL_NVLS_ENABLE -x CANOPY_KERNEL_CACHE \
  $BIN "${ARGS[@]}" > $OUT/r/mpi.json 2> $OUT/r/mpi.err; echo "mpirun -np 2 exit $?"
show $OUT/r/mpi.json; grep -m1 note $OUT/r/mpi.err
cd $OUT && tar czf all.tgz r && rm -rf r
