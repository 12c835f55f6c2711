#!/usr/bin/env bash
# Where a served run's time goes between decode and prefill: `canopy bench serve` (in process)
# on the 8B shape with random weights, greedy, for each DATASETS × METHODS × CHUNKS
# (`--prefill-chunk`), with the runtime's debug lines on. Per run: its throughput, TTFT and
# inter-token latency, its steps' shares, and its prefill passes (count, rows, the decode rows
# that led them, and the host's milliseconds planning, launching and reading them). MODEL,
# CONCURRENCY, PROMPTS, OUTPUT_LEN and LENGTHS (extra dataset options) override the defaults;
# RATE sets the arrivals (requests a second, Poisson; default all at once), CANOPY_BIN the
# binary, or BINS several (name=path ...; each run's name then starts with the binary's);
# RUST_LOG the debug lines kept (default the runtime's). Per
# run also its decode steps: replayed from a recorded pass, or not. Results:
# $OUT/serve-phases.txt, each run's JSON report in $OUT/phases/ and its log in $OUT/logs/.
set -uo pipefail
source "$(dirname "$0")/env.sh"
MODEL=${MODEL:---arch llama-3.1-8b --random-weights --backend cuda --max-context 20480 --kv-tokens 131072}
DATASETS=${DATASETS:-few-shot multi-doc}
METHODS=${METHODS:-auto q-guided}
CHUNKS=${CHUNKS:-8192}
C=${CONCURRENCY:-64} N=${PROMPTS:-128} O=${OUTPUT_LEN:-128} LENGTHS=${LENGTHS:-} RATE=${RATE:-inf}
mkdir -p "$OUT/phases" "$OUT/logs"
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  for entry in ${BINS:-new=$BIN}; do
    ${entry#*=} compile-kernels > /dev/null 2>&1 || echo "compile-kernels FAILED: $entry"
  done
  for d in $DATASETS; do
    for m in $METHODS; do
      for c in $CHUNKS; do
        for entry in ${BINS:-new=$BIN}; do
          BIN=${entry#*=} name=${BINS:+${entry%%=*}-}$d-$m-$c
          log "${BINS:+${entry%%=*}: }$d, --method $m, --prefill-chunk $c"
          RUST_LOG=${RUST_LOG:-canopy_runtime=debug} timeout 200 $BIN bench serve $MODEL --method "$m" \
            --max-batch "$C" --prefill-chunk "$c" --dataset "$d" --num-prompts "$N" \
            --max-concurrency "$C" --output-len "$O" --request-rate "$RATE" $LENGTHS \
            --temperature 0 --json > "$OUT/phases/$name.json" 2> "$OUT/logs/$name.log" \
            || { log "FAILED: $name"; tail -3 "$OUT/logs/$name.log"; continue; }
          python3 "$(dirname "$0")/tools/serve_log.py" phases "$OUT/phases/$name.json" "$OUT/logs/$name.log"
        done
      done
    done
  done
} 2>&1 | tee "$OUT/serve-phases.txt"
