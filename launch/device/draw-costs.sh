#!/usr/bin/env bash
# Where a served step spends the host's time: `canopy bench serve` on the 8B shape with random
# weights (few-shot: 128 requests behind one 4K-token prompt, 64 at a time, 128 tokens each)
# for each SAMPLINGS entry (name=options, `_` for a space), with the runtime's debug lines on.
# Per event, the median of each phase over the steps that decode 64 rows and prefill nothing:
# - "serve step": schedule_ms (the scheduler's next step), books_ms (pages and rows), pass_ms
#   (the decode pass), observe_ms (draws, stops, streams);
# - "serve decode step": layout_ms (the plan grown or made, the page table), decode_ms (the
#   pass: stage, launch, wait, download), reads_ms (rows read further);
# - "decode pass": launch_ms (inputs staged, the pass launched), download_ms (the GPU's wait
#   and the logits' copy);
# - "draws": draw_ms (draws from narrowed rows), tails_ms (walks past them on the device),
#   read_ms and redraw_ms (rows read whole);
# beside the run's throughput and shares of its steps. MODEL, PREFIX and OUTPUT replace the
# server's model options, the prompt's shared prefix and the output length. With LOGS_ONLY=1
# it only summarizes the logs an earlier run left in /tmp. Results: $OUT/draw-costs.txt.
set -uo pipefail
source "$(dirname "$0")/env.sh"
MODEL=${MODEL:---arch llama-3.1-8b --random-weights --backend cuda --max-context 8192 --kv-tokens 131072}
PREFIX=${PREFIX:-4096} OUTPUT=${OUTPUT:-128}
SAMPLINGS=${SAMPLINGS:-greedy=--temperature_0 t1=--temperature_1 top-p=--temperature_1_--top-p_0.9}
{
  [ -n "${LOGS_ONLY:-}" ] || $BIN compile-kernels > /dev/null 2>&1 || echo "compile-kernels FAILED"
  for entry in $SAMPLINGS; do
    name=${entry%%=*} opts=${entry#*=}
    log "$name (${opts//_/ })"
    [ -n "${LOGS_ONLY:-}" ] || RUST_LOG=canopy_runtime=debug $BIN bench serve $MODEL \
      --max-batch 64 --dataset few-shot --prefix-len $PREFIX --num-prompts 128 --max-concurrency 64 \
      --output-len $OUTPUT ${opts//_/ } --json > "/tmp/$name.json" 2> "/tmp/$name.log"
    python3 "$(dirname "$0")/tools/serve_log.py" costs "/tmp/$name.json" "/tmp/$name.log"
  done
} 2>&1 | tee "$OUT/draw-costs.txt"
