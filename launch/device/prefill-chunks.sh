#!/usr/bin/env bash
# The prefill's attention launch by launch (issue 23): a CONTEXT prefill (Llama-3.1-8B shape,
# random weights, chunks of 8K) traced with CUPTI, the trace kept (each launch's duration, so
# each chunk's rate), the SM clock and power sampled beside it by nvidia-smi; then Nsight
# Compute's speed of light on the attention of layer LAYER in every chunk, run alone, clocks as
# they are. Results: $OUT/trace.tsv.gz, $OUT/clocks.csv, $OUT/ncu-chunk*.txt, log.txt.
set -uo pipefail
source "$(dirname "$0")/env.sh"
CONTEXT=${CONTEXT:-32K}
LAYER=${LAYER:-16}
CHUNKS=${CHUNKS:-4}
{
  tracer=$(build_tracer)
  bench() { $BIN bench decode --arch llama-3.1-8b --random-weights --context "$CONTEXT" --ranks 1 \
    --strategy tree --decode 3 --prefill-chunk 8K --json 2>/dev/null | python3 -c 'import json,sys
r=json.load(sys.stdin)
for x in r["rows"]: print(f"  prefill {x["fill_s"]:.3f} s, {x["prefill_tflops_per_device"]:.0f} TFLOP/s (GEMM rate {r["gemm_tflops"]:.0f})")'; }
  $BIN compile-kernels > /dev/null 2>&1
  log "bench decode, untraced"
  bench
  log "the same, traced, clocks sampled"
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active \
    --format=csv -lms 50 > "$OUT/clocks.csv" 2>&1 &
  smi=$!
  CUDA_INJECTION64_PATH=$tracer CUPTI_TRACE_OUT=/tmp/trace.tsv bench
  kill $smi
  # 32 layers of 4 chunks, less the last layer of the first 3.
  python3 "$(dirname "$0")/tools/timeline.py" /tmp/trace.tsv 125 > /tmp/timeline.txt
  head -3 /tmp/timeline.txt
  gzip -c /tmp/trace.tsv > "$OUT/trace.tsv.gz"
  for c in $(seq 0 $((CHUNKS - 1))); do
    log "ncu: chunk $c, layer $LAYER"
    ncu --clock-control none --kernel-name prefill_attention --launch-skip $((c * 32 + LAYER)) --launch-count 1 \
      --section SpeedOfLight $BIN generate --arch llama-3.1-8b --random-weights --backend cuda \
      --context "$CONTEXT" --context-fill prefill --max-tokens 1 2>&1 | grep -E "prefill_attention|Frequency|Duration|Compute \(SM\)" \
      | tee "$OUT/ncu-chunk$c.txt"
  done
} 2>&1 | tee "$OUT/log.txt"
