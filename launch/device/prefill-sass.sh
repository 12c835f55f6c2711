#!/usr/bin/env bash
# Where the prefill's attention kernel spends its issue slots (issue 23): its SASS and resource
# use as NVRTC built it, then Nsight Compute's per-instruction stall samples on one
# `prefill_attention` launch of the last chunk of a CONTEXT prefill (Llama-3.1-8B shape, random
# weights, chunks of 8K), clocks left as they are. Results: $OUT/sass.txt.gz (resources and
# SASS), $OUT/source.csv.gz (the source page, per SASS instruction), $OUT/details.txt.
set -uo pipefail
source "$(dirname "$0")/env.sh"
CONTEXT=${CONTEXT:-32K}
SKIP=${SKIP:-112}
export CANOPY_KERNEL_CACHE=/tmp/sass-cache
rm -rf "$CANOPY_KERNEL_CACHE"
${SOURCES:+env CANOPY_KERNEL_SOURCES=$SOURCES} $BIN compile-kernels > /dev/null 2>&1
{
  for cubin in "$CANOPY_KERNEL_CACHE"/*prefill*; do
    echo "### $cubin"
    cuobjdump -res-usage "$cubin" 2>&1 | grep -A1 prefill_attention
    cuobjdump -sass -fun prefill_attention "$cubin"
  done
} | gzip > "$OUT/sass.txt.gz"
ncu --query-metrics --chip gh100 2>/dev/null | grep -i -E "gmma|pipe_tensor" > "$OUT/metrics.txt"
log "ncu: prefill_attention launch $SKIP"
ncu --clock-control none --kernel-name prefill_attention --launch-skip "$SKIP" --launch-count 1 \
  --section SpeedOfLight --section WarpStateStats --section SourceCounters --section ComputeWorkloadAnalysis \
  --section MemoryWorkloadAnalysis --section Occupancy -o /tmp/attn -f \
  ${SOURCES:+env CANOPY_KERNEL_SOURCES=$SOURCES} $BIN generate --arch llama-3.1-8b --random-weights --backend cuda \
  --context "$CONTEXT" --context-fill prefill --max-tokens 1 > "$OUT/generate.txt" 2>&1
ncu -i /tmp/attn.ncu-rep --page details > "$OUT/details.txt" 2>&1
ncu -i /tmp/attn.ncu-rep --page source --csv --print-source sass 2>&1 | gzip > "$OUT/source.csv.gz"
grep -E "Duration|Throughput|Frequency|Issue|Pipe|Stall|Warp Cycles" "$OUT/details.txt" | head -40
ls -la "$OUT"
