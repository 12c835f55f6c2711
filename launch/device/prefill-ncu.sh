#!/usr/bin/env bash
# Nsight Compute on one `prefill_attention` launch of a real prefill (Llama-3.1-8B shape, random
# weights, CONTEXT tokens, chunks of 8K) for every entry of BINS ("name=path", a path may end in
# +DIR, kernel sources the binary compiles instead of its own): speed of light, warp stalls and
# the warpgroup MMA pipe. Results: $OUT/ncu-NAME.txt.
set -uo pipefail
source "$(dirname "$0")/env.sh"
BINS=${BINS:-new=$BIN}
CONTEXT=${CONTEXT:-16K}
for entry in $BINS; do
  name=${entry%%=*} bin=${entry#*=} sources=
  case $bin in *+*) sources=${bin#*+} bin=${bin%%+*} ;; esac
  env ${sources:+CANOPY_KERNEL_SOURCES=$sources} $bin compile-kernels > /dev/null 2>&1
  log "ncu, $name"
  env ${sources:+CANOPY_KERNEL_SOURCES=$sources} ncu --kernel-name prefill_attention --launch-skip "${SKIP:-20}" \
    --launch-count 1 --section SpeedOfLight --section WarpStateStats --section Occupancy \
    --metrics sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_tensor_op_gmma.sum,smsp__inst_executed.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,lts__t_bytes.sum \
    $bin generate --arch llama-3.1-8b --random-weights --backend cuda --context "$CONTEXT" \
    --context-fill prefill --max-tokens 1 > "$OUT/ncu-$name.txt" 2>&1
  grep -E "Duration|Throughput|gmma|inst_executed|bank_conflicts|lts__t_bytes|Warp Cycles|Stall|Achieved Occupancy|Registers" "$OUT/ncu-$name.txt" | head -40
done
