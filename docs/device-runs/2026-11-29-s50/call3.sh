#!/usr/bin/env bash
# Session 50, call 3 (one H200): decode_partial_ws with its consumers pipelined (the next tile's
# S issued with this tile's P V, turns between the two, 56/224 registers), launched as the
# programmatic dependent of the plan's other CTAs. The kernels' resources, the conformance
# suite on one rank, Nsight Compute's kernel durations on the batch-64 shape, ab-tree against
# 6cb2401's build, then the device tests.
set -uo pipefail
source launch/device/env.sh
export OUT
NCU=/usr/local/cuda/bin/ncu
$BIN compile-kernels 2>&1 | tail -1 | tee "$OUT/compile.txt"
for c in /tmp/canopy-kernels/decode_mma-sm_90a-*.cubin; do
  /usr/local/cuda/bin/cuobjdump -res-usage "$c" 2>/dev/null | grep -A1 "decode_partial_ws" >> "$OUT/compile.txt"
done
timeout 150 $BIN selftest --backend cuda --ranks 1 --cases 1 --kernel mma > "$OUT/selftest-full.txt" 2>&1
echo "selftest rc $?" > "$OUT/selftest.txt"
grep -E "FAIL|passed|failed" "$OUT/selftest-full.txt" | tail -20 >> "$OUT/selftest.txt"
tree_toml shared "1, 64" "4096, 16"
$NCU --cache-control all --clock-control none -k regex:'decode_partial|merge_partials' \
  --launch-skip 6 --launch-count 6 --csv --print-units base \
  --metrics gpu__time_duration.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active \
  $BIN bench tree --workload /tmp/shared.toml --method auto --iterations 3 --check false 2>/dev/null \
  | grep -E '^"[0-9]' | awk -F'","' '{print $5, $(NF-2), $NF}' | sed 's/"//g' > "$OUT/ncu.txt"
A_BIN=.device/canopy-base B_BIN=.device/canopy \
TREES="/tmp/shared.toml configs/workloads/serve-few-shot.toml configs/workloads/serve-system-prompt.toml configs/workloads/serve-multi-doc.toml configs/workloads/serve-multi-chain.toml 4 6" \
HEADS=8 METHODS=auto,q-guided CHECK=true ROUNDS=2 timeout 240 bash launch/device/ab-tree.sh > /dev/null 2>&1
echo "ab-tree rc $?" >> "$OUT/ab-log.txt"
[ $SECONDS -lt 520 ] && timeout $((580 - SECONDS)) bash -c 'source launch/device/env.sh; device_tests' > /dev/null 2>&1
cd "$OUT" && tar czf all.tgz *.txt ab.tgz 2>/dev/null; ls
