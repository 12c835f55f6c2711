#!/usr/bin/env bash
# Serving with decode steps replayed from recorded CUDA graphs (issue 23): the tiny model
# served on the GPU against `canopy generate` on the CPU (serve.sh's check, graphs on), then
# `bench serve` on the 8B shape (random weights) at CONCURRENCY 1, 4 and 16 against a server
# with graphs and one with --eager, short random prompts. Results under $OUT.
set -uo pipefail
source "$(dirname "$0")/env.sh"
DEADLINE=${DEADLINE:-400}
R=$OUT/serve-graphs
mkdir -p "$R"
{
  # serve.sh's check alone: its servers of the 8B shape start only with a minute left.
  if [ "${CHECK:-1}" = 1 ]; then
    DEADLINE=60 OUT=$R bash "$(dirname "$0")/serve.sh" > "$R/check-log.txt" 2>&1
    grep -h "check:" "$R/check-log.txt" | tail -2
  fi
  for mode in graphs eager; do
    flag=; [ $mode = eager ] && flag=--eager
    $BIN serve --port 0 --arch llama-3.1-8b --random-weights --backend cuda --max-context 4096 \
      --kv-tokens 65536 $flag > "$R/server-$mode.log" 2>&1 &
    pid=$! url=
    while [ -z "$url" ] && kill -0 $pid 2>/dev/null; do
      sleep 0.5; url=$(grep -o 'listening on http://[0-9.:]*' "$R/server-$mode.log" | head -1 | cut -d' ' -f3)
    done
    # Warm-up: kernels are compiled on first use.
    timeout 120 $BIN bench serve --url "$url" --json --dataset random --input-len 64 \
      --num-prompts 4 --output-len 8 > /dev/null 2>&1
    for c in ${CONCURRENCY:-1 4 16}; do
      [ $SECONDS -gt "$DEADLINE" ] && { echo "SKIPPED $mode c=$c"; continue; }
      timeout 120 $BIN bench serve --url "$url" --json --dataset random --input-len 256 \
        --num-prompts $((c * 4)) --max-concurrency "$c" --output-len 64 --seed 0 > "$R/bench-$mode-c$c.json" 2> "$R/bench-$mode-c$c.err"
      python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); d=r.get("decode") or {}
print(sys.argv[2], sys.argv[3], "done", r["completed"], "%.2f s" % r["duration_s"], "out tok/s %.1f" % r["output_throughput"], "TTFT med %.1f ms" % r["ttft_ms"]["median"], "TPOT med %.2f ms" % r["tpot_ms"]["median"], "decode pass %.2f ms" % d.get("mean_ms", 0))' \
        "$R/bench-$mode-c$c.json" "$mode" "c=$c" || tail -3 "$R/bench-$mode-c$c.err"
    done
    kill -TERM $pid; wait $pid
  done
} 2>&1 | tee "$OUT/serve-graphs.txt"
tar czf "$OUT/serve-graphs.tgz" -C "$OUT" serve-graphs
