#!/usr/bin/env bash
# Session 50, call 4 (one H200): what bounds decode_partial_ws on the batch-64 shape. Nsight
# Compute's durations of the kernels with the working tree's decode_ws.cu, then with two
# diagnostic variants of it (results not checked): `nocopy`, whose copying warpgroup arrives on
# each stage without copying, and `nomath`, whose consumers only wait for each tile and release it.
set -uo pipefail
source launch/device/env.sh
export OUT
NCU=/usr/local/cuda/bin/ncu
tree_toml shared "1, 64" "4096, 16"
for v in crate nocopy nomath; do
  envs=""
  [ $v != crate ] && envs="CANOPY_KERNEL_SOURCES=.device/variants/$v CANOPY_KERNEL_CACHE=/tmp/kc-$v"
  echo "== $v" >> "$OUT/ncu.txt"
  env $envs $NCU --cache-control all --clock-control none -k regex:'decode_partial_ws' \
    --launch-skip 4 --launch-count 3 --csv --print-units base \
    --metrics gpu__time_duration.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sector_hit_rate.pct \
    $BIN bench tree --workload /tmp/shared.toml --method auto --iterations 3 --check false 2>/dev/null \
    | grep -E '^"[0-9]' | awk -F'","' '{print $5, $(NF-2), $NF}' | sed 's/"//g' >> "$OUT/ncu.txt"
done
cat "$OUT/ncu.txt"
