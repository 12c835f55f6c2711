#!/usr/bin/env bash
# Call 2: the batch size held about its edge (`held`, the build of 0be1cc4) against call 1's `new`
# and `base`: the tiny model served on 2 ranks of the GPU against `generate` on 2 ranks
# (serve_fields.py sampled: 24 concurrent sampled requests, padded and recorded steps); then
# few-shot, multi-doc and multi-chain at 40 requests a second (arrivals-ab.sh, 192 requests),
# and few-shot and multi-doc again, `base` first; few-shot at 20 a second.
set -uo pipefail
source launch/device/env.sh
DEADLINE=585
TINY=tests/fixtures/tiny/gqa-hd64
{
  log "tiny model, 2 ranks on the GPU, served against generate"
  python3 -c "import json; print(json.dumps([p['token_ids'] for p in json.load(open('$TINY/reference.json'))['prompts']]))" > /tmp/prompts.json
  start_server gpu-tiny-2 --model $TINY --backend cuda --dtype f32 --ranks 2
  RANKS=2 python3 launch/device/serve_fields.py sampled "$URL" "$BIN" $TINY /tmp/prompts.json | tail -3
  grep -c "replayed=true" "$OUT/server-gpu-tiny-2.log"
  stop_server "$SERVER"
  log "40 a second, held first"
  RATES="40" TESTS= OUT=$OUT/r1 DATASETS="few-shot multi-doc multi-chain" \
    BINS="held=.device/canopy new=.device/new1 base=.device/base" bash launch/device/arrivals-ab.sh
  grep -E "^==|tokens/s|decode steps" "$OUT/r1/rate-40.txt"
  log "40 a second, base first"
  RATES="40" TESTS= OUT=$OUT/r2 DATASETS="few-shot multi-doc" \
    BINS="base=.device/base held=.device/canopy" bash launch/device/arrivals-ab.sh
  grep -E "^==|tokens/s|decode steps" "$OUT/r2/rate-40.txt"
  log "20 a second"
  RATES="20" TESTS= OUT=$OUT/r3 DATASETS="few-shot" \
    BINS="held=.device/canopy base=.device/base" bash launch/device/arrivals-ab.sh
  grep -E "^==|tokens/s|decode steps" "$OUT/r3/rate-20.txt"
  log "done"
  cd "$OUT" && tar czf runs.tgz r1 r2 r3 && rm -rf r1 r2 r3
} 2>&1 | tee "$OUT/call2.txt"
