#!/usr/bin/env bash
# Sampling's cost in serving, build against build: `canopy bench serve` on the 8B shape with
# random weights (few-shot: 128 requests behind one 4K-token prompt, 64 at a time, 128 tokens
# each), greedy, at temperature 1 (OpenAI's default) and at temperature 1 with top_p 0.9, for
# each binary of BINS (name=path; default base=.device/canopy-base new=.device/canopy), the
# binaries taking turns within each sampling, ROUNDS times (default 1). Every binary compiles
# its kernels first, so that no run times their compiling.
# Run from the repository root on the device machine. Results: $OUT/sampling-ab.txt and
# $OUT/ab-NAME-SAMPLING-ROUND.json.
set -uo pipefail
source "$(dirname "$0")/env.sh"
BINS=${BINS:-base=.device/canopy-base new=.device/canopy}
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  for entry in $BINS; do "${entry#*=}" compile-kernels > /dev/null 2>&1 || echo "${entry%%=*}: compile-kernels FAILED"; done
  for round in $(seq "${ROUNDS:-1}"); do
    for sampling in "greedy" "t1:--temperature 1" "top-p:--temperature 1 --top-p 0.9"; do
      name=${sampling%%:*} flags=${sampling#*:}
      [ "$name" = greedy ] && flags=
      for entry in $BINS; do
        bin=${entry#*=} tag=${entry%%=*}
        json=$OUT/ab-$tag-$name-$round.json
        $bin bench serve --arch llama-3.1-8b --random-weights --backend cuda --max-context 8192 \
          --kv-tokens 131072 --max-batch 64 --dataset few-shot --prefix-len 4096 --num-prompts 128 \
          --max-concurrency 64 --output-len 128 $flags --json > "$json" 2> /dev/null
        python3 -c "import json; r=json.load(open('$json')); print('round $round', '$tag', '$name', r['completed'], 'completed,', round(r['output_throughput']), 'output tokens/s, TPOT median', round(r['tpot_ms']['median'], 2), 'ms')" \
          || echo "$tag $name FAILED"
      done
    done
  done
} 2>&1 | tee "$OUT/sampling-ab.txt"
