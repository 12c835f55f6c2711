#!/usr/bin/env bash
# Call 3 (nvidia-h200-x2): the build of 0be1cc4 (`held`) on two GPUs: `sanitizer.sh`; the tiny
# model served under compute-sanitizer's memcheck (bf16, 24 concurrent sampled requests: padded,
# replanned and replayed decode steps) and on 2 ranks (one a GPU, the tree over NCCL) against
# `generate` on 2 ranks; few-shot at 40 requests a second on 2 ranks, `held` against `base`.
set -uo pipefail
source launch/device/env.sh
DEADLINE=585
TINY=tests/fixtures/tiny/gqa-hd64
SAN=/usr/local/cuda-13.0/bin/compute-sanitizer
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  log "sanitizer.sh"
  OUT=$OUT/san bash launch/device/sanitizer.sh > /dev/null 2>&1
  cat "$OUT/san/sanitizer.txt"
  python3 -c "import json; print(json.dumps([p['token_ids'] for p in json.load(open('$TINY/reference.json'))['prompts']]))" > /tmp/prompts.json
  log "tiny model served under memcheck (bf16)"
  "$SAN" --tool memcheck --print-limit 20 $BIN serve --port 0 --model $TINY --backend cuda --dtype bf16 \
    > "$OUT/server-memcheck.log" 2>&1 &
  SERVER=$! URL=
  for _ in $(seq 150); do
    [ -z "$URL" ] && kill -0 $SERVER 2>/dev/null || break
    sleep 1; URL=$(grep -o 'listening on http://[0-9.:]*' "$OUT/server-memcheck.log" | head -1 | cut -d' ' -f3)
  done
  log "memcheck server at $URL"
  timeout 240 python3 - "$URL" <<'PY'
import json, sys, urllib.request
from concurrent.futures import ThreadPoolExecutor
url, prompts = sys.argv[1], json.load(open("/tmp/prompts.json"))
def go(i):
    body = {"prompt": prompts[i % 4], "max_tokens": 24, "temperature": 0.8, "seed": i}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=230))["usage"]["completion_tokens"]
with ThreadPoolExecutor(24) as ex:
    print("completion tokens:", sum(ex.map(go, range(24))))
PY
  # The server is the sanitizer's child: drained by its own SIGTERM.
  pkill -TERM -P $SERVER
  timeout 90 tail --pid=$SERVER -f /dev/null || kill -9 $SERVER
  grep -E "ERROR SUMMARY|Invalid|out of bounds" "$OUT/server-memcheck.log" | head -5
  log "tiny model, 2 ranks (2 GPUs), served against generate"
  start_server gpu-tiny-2 --model $TINY --backend cuda --dtype f32 --ranks 2
  RANKS=2 python3 launch/device/serve_fields.py sampled "$URL" "$BIN" $TINY /tmp/prompts.json | tail -2
  stop_server "$SERVER"
  log "few-shot at 40 a second, 2 ranks"
  MODEL="--arch llama-3.1-8b --random-weights --backend cuda --max-context 20480 --kv-tokens 131072 --ranks 2" \
    RATES="40" TESTS= OUT=$OUT/r1 DATASETS="few-shot" \
    BINS="held=.device/canopy base=.device/base" bash launch/device/arrivals-ab.sh
  grep -E "^==|tokens/s|decode steps" "$OUT/r1/rate-40.txt"
  log "done"
  cd "$OUT" && tar czf runs.tgz san r1 server-*.log && rm -rf san r1
} 2>&1 | tee "$OUT/call3.txt"
