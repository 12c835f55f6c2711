#!/usr/bin/env bash
# A served prompt's prefill on several ranks of one GPU, each rank running the rows whose KV
# it stores, against a base build:
# 1. the tiny fixture model (f32) served on the GPU at 2 ranks, tree and ring, against the
#    CPU at one rank (serve_fields.py check: texts equal, log-probabilities within 2e-3);
# 2. `canopy bench serve` on the 8B shape with random weights, one random 16K-token prompt at
#    a time (two prompt chunks of 8K, the second over the first's cached KV), 4 output tokens,
#    at each RANKS:STRATEGY of RUNS (default "1:tree 2:tree 2:ring"), with each binary of
#    BINS (name=path; default new=.device/canopy base=.device/canopy-base), in turn; the TTFT
#    of each.
# Run from the repository root on the device machine. Results: $OUT/split.txt and
# $OUT/bench-NAME-RANKS-STRATEGY-rROUND.json (round 2 runs the binaries in the other order).
set -uo pipefail
source "$(dirname "$0")/env.sh"
DEADLINE=${DEADLINE:-540}
TINY=tests/fixtures/tiny/gqa-hd64
PY=launch/device/serve_fields.py
BINS=${BINS:-new=.device/canopy base=.device/canopy-base}
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import json; print(json.dumps([p['token_ids'] for p in json.load(open('$TINY/reference.json'))['prompts']]))" > /tmp/prompts.json
  start_server cpu-tiny --model $TINY --backend cpu && CPU_PID=$SERVER CPU_URL=$URL
  for strategy in tree ring; do
    start_server gpu2-tiny-$strategy --model $TINY --backend cuda --dtype f32 --ranks 2 \
      --strategy $strategy || continue
    log "check: 2 ranks ($strategy) on the GPU against 1 on the CPU"
    python3 $PY check "$URL" "$CPU_URL" /tmp/prompts.json | tail -1
    stop_server "$SERVER"
  done
  stop_server "$CPU_PID"
  for round in 1 2; do
    order=$BINS
    [ $round = 2 ] && order=$(echo $BINS | tr ' ' '\n' | tac | tr '\n' ' ')
    for entry in $order; do
      name=${entry%%=*} bin=${entry#*=}
      for run in ${RUNS:-1:tree 2:tree 2:ring}; do
        set -- ${run/:/ }
        [ "$(left)" -lt 60 ] && { log "stopped: $(left) s left"; break 3; }
        log "round $round, $name, $1 ranks, $2"
        json=$OUT/bench-$name-$1-$2-r$round.json
        timeout $(( DEADLINE - SECONDS )) $bin bench serve --arch llama-3.1-8b --random-weights \
          --backend cuda --ranks $1 --strategy $2 --max-context 20480 --kv-tokens 65536 \
          --dataset random --input-len 16384 --range-ratio 0 --output-len 4 --num-prompts 3 \
          --max-concurrency 1 --json > "$json" 2> "${json%.json}.err"
        python3 -c "import json; r=json.load(open('$json')); t=r['ttft_ms']; print('$name ranks $1 $2: TTFT mean %.0f ms, median %.0f ms, %d completed' % (t['mean'], t['median'], r['completed']))" \
          || tail -3 "${json%.json}.err"
      done
    done
  done
} 2>&1 | tee "$OUT/split.txt"
