#!/usr/bin/env bash
# Call 5: the build of 88594ce (the page tables' room): sampling-check.sh (the device
# tests among it, each binary's whole output kept; the tiny model served on the GPU against `generate`, 24 concurrent sampled requests, so steps of several
# batch sizes replayed), then the tiny model served on 2 ranks of the GPU against `generate`
# on 2 ranks (recordings voted on by both ranks).
set -uo pipefail
source launch/device/env.sh
DEADLINE=585
TINY=tests/fixtures/tiny/gqa-hd64
{
  log "sampling-check"
  DEADLINE=300 OUT=$OUT/check bash launch/device/sampling-check.sh > /dev/null 2>&1
  grep -E "test result|FAILED|panicked|SEED" "$OUT/check/tests.txt"
  tail -25 "$OUT/check/check.txt"
  log "tiny model, 2 ranks on the GPU, served against generate"
  python3 -c "import json; print(json.dumps([p['token_ids'] for p in json.load(open('$TINY/reference.json'))['prompts']]))" > /tmp/prompts.json
  start_server gpu-tiny-2 --model $TINY --backend cuda --dtype f32 --ranks 2
  RANKS=2 python3 launch/device/serve_fields.py sampled "$URL" "$BIN" $TINY /tmp/prompts.json | tail -3
  grep -c "replayed=true" "$OUT/server-gpu-tiny-2.log"
  stop_server "$SERVER"
  log "done"
  cd "$OUT" && tar czf runs.tgz check && rm -rf check
} 2>&1 | tee "$OUT/call5.txt"
