#!/usr/bin/env bash
# Where a prefill's wall time goes (issue 23): `bench decode` of the Llama-3.1-8B shape (random
# bf16 weights, one rank, a real prefill of CONTEXT tokens in chunks of CHUNK, after its
# warm-up) for each of BINS ("name=path ..."): ROUNDS timed runs, then one under a CUPTI
# activity trace (tools/cupti_trace.c, built here against the CUPTI that the machine has) read
# by tools/timeline.py: the GPU's busy share of the prefill, its idle gaps with the host driver
# calls that overlapped them, and kernel time by name. Results: $OUT/timeline-NAME.txt, log.txt.
set -uo pipefail
source "$(dirname "$0")/env.sh"
BINS=${BINS:-new=$BIN}
CONTEXT=${CONTEXT:-32K}
CHUNK=${CHUNK:-8K}
# The prefill's attention launches: 32 layers of each of its 4 chunks, less the last layer of
# the first 3 (a piece without the prompt's last row stops at its keys there).
LAUNCHES=${LAUNCHES:-125}
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  tracer=$(build_tracer)
  for entry in $BINS; do
    name=${entry%%=*} bin=${entry#*=}
    bench() { $bin bench decode --arch llama-3.1-8b --random-weights --context "$CONTEXT" --ranks 1 \
      --strategy tree --decode 3 --prefill-chunk "$CHUNK" --json 2>/dev/null | python3 -c 'import json,sys
r=json.load(sys.stdin)
for x in r["rows"]: print(f"  prefill {x["fill_s"]:.3f} s, {x["prefill_tflops_per_device"]:.0f} TFLOP/s (GEMM rate {r["gemm_tflops"]:.0f}), peak {(x["peak_bytes"] or 0)/2**30:.1f} GiB")'; }
    $bin compile-kernels > /dev/null 2>&1 || echo "compile-kernels FAILED: $name"
    for round in $(seq "${ROUNDS:-2}"); do
      log "$name: bench decode, prefill $CONTEXT in chunks of $CHUNK (round $round)"
      bench
    done
    [ -z "$tracer" ] && continue
    log "$name: the same, traced"
    CUDA_INJECTION64_PATH=$tracer CUPTI_TRACE_OUT=/tmp/trace-$name.tsv bench
    python3 "$(dirname "$0")/tools/timeline.py" "/tmp/trace-$name.tsv" "$LAUNCHES" | tee "$OUT/timeline-$name.txt"
  done
} 2>&1 | tee "$OUT/log.txt"
