#!/usr/bin/env bash
# Issue 23's baseline: `bench decode` on real model shapes with random weights and a random
# context (no prefill), tree vs ring, 1 and 2 ranks on the one GPU, beside the floor. Results
# as JSON per shape under $OUT, the tables in decode-log.txt. CONTEXTS, LONG and LIMIT narrow
# the run.
set -uo pipefail
source "$(dirname "$0")/env.sh"
run() { # name limit args...
  local name=$1 limit=$2
  shift 2
  timeout "$limit" $BIN bench decode --random-weights --context-fill random --decode 10 "$@" \
    --json > "$OUT/decode-$name.json" || echo "FAILED or cut off: $name"
  python3 - "$OUT/decode-$name.json" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as e:
    sys.exit(f"no report: {e}")
print(f"{r['model']} ({r['dtype']}), weights {r['weight_bytes']/1e9:.2f} GB, copy {r['copy_bandwidth_gb_s']:.0f} GB/s")
print(f"{'context':>8} {'P':>2} {'strategy':>16} {'fill s':>7} {'ms/token':>9} {'floor ms':>9} {'x floor':>8}")
for x in r["rows"]:
    print(f"{x['context']:>8} {x['ranks']:>2} {x['strategy']:>16} {x['fill_s']:>7.2f} "
          f"{x['decode_ms_per_token']:>9.2f} {x['floor_ms']:>9.2f} {x['vs_floor']:>8.2f}")
PY
}
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  run llama-3.1-8b "${LIMIT:-300}" --arch llama-3.1-8b --context "${CONTEXTS:-8K,32K}" \
    --ranks 1,2 --strategy tree,ring
  run llama-3.1-8b-long "${LIMIT:-300}" --arch llama-3.1-8b --context "${LONG:-64K,120K}" \
    --ranks 1 --strategy tree,ring
  run llama-3.2-1b 120 --arch llama-3.2-1b --context 8K,32K --ranks 1,2 --strategy tree,ring
} 2>&1 | tee "$OUT/decode-log.txt"
