#!/usr/bin/env bash
# Where the time of a tree step goes on one GPU: FastTree's tree 4 split into its root-heavy and
# leaf-heavy halves (synthetic trees of the same shape), each stage-1 kernel alone, and ncu's
# per-kernel duration, occupancy and stall reasons for the real trees. Used to steer kernel work;
# results under $OUT.
set -uo pipefail
source "$(dirname "$0")/env.sh"
NCU=${NCU:-/usr/local/cuda/bin/ncu}
tree_toml root-heavy "1, 1024" "2048, 1"
tree_toml leaf-heavy "1, 1024" "1, 32"
tree_toml leaf-long "1, 1024" "1, 256"
run() { $BIN bench tree --heads 32 --head-dim 128 --dtype f16 --iterations ${ITER:-20} --check false "$@" | tail -n +4 | awk '{print $1, $(NF-5), $(NF-2), $(NF-1), $NF}'; }
for kv in ${HEADS:-8 32}; do
  for w in ${WORKLOADS:-fasttree-4 /tmp/root-heavy.toml /tmp/leaf-heavy.toml /tmp/leaf-long.toml}; do
    for k in ${KERNELS:-mma simt}; do
      for tile in ${TILES:-64}; do
        echo "== $w 32/$kv kernel $k tile $tile"
        run --workload $w --kv-heads $kv --method ${METHODS:-deft-node,fasttree} --kernel $k --mma-tile $tile
      done
    done
  done
done
if [ -x "$NCU" ]; then
  for spec in "fasttree-4 8 fasttree" "fasttree-9 8 fasttree" "fasttree-0 8 deft-node-chunk" "fasttree-4 32 deft-flatten"; do
    set -- $spec
    echo "== ncu $1 32/$2 $3"
    $NCU -k regex:'decode_partial|merge_partials' --launch-skip 6 --launch-count 2 \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
      --metrics gpu__time_duration.sum,smsp__inst_executed.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum \
      $BIN bench tree --workload $1 --heads 32 --kv-heads $2 --head-dim 128 --dtype f16 \
      --method $3 --iterations 3 --check false > "$OUT/ncu_$1_$2_$3.txt" 2>&1
    grep -E "decode_partial|merge_partials|Duration|Achieved Occupancy|Registers Per|Theoretical Occ|Stall|Warp Cycles Per Issued|Compute \(SM\) Throughput|Memory Throughput|inst_executed|wavefronts|Grid Size|Block Limit" "$OUT/ncu_$1_$2_$3.txt" | head -60
  done
fi
