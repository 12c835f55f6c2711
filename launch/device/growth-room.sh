#!/usr/bin/env bash
# Growth room (issues 23 and 24): decoding leaves keep addresses free past their tokens, so
# the pages they take go into the page table in place and the plan and the recorded decode
# pass carry over page boundaries. First the replay-equals-eager test (its runs now cross
# pages inside recorded passes) and the layer-op tests; then `canopy serve` (8B shape, random
# weights, --method auto) of this build and of .device/canopy-base (the build before) on the
# few-shot and multi-doc datasets, with each server's decode steps counted from its
# `serve decode step` debug events (planned afresh, replayed); then `canopy generate` step
# phases at N samples (profile-batch.sh). Results under $OUT.
set -uo pipefail
source "$(dirname "$0")/env.sh"
DEADLINE=${DEADLINE:-560}
R=$OUT/serve
mkdir -p "$R"
C=${CONCURRENCY:-64}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
device_tests

# steps LOG: decode steps of a server's log, planned afresh and replayed.
steps() {
  python3 -c '
import re, sys
rows = [dict(re.findall(r"(\w+)=(\S+)", re.sub(r"\x1b\[[0-9;]*m", "", l)))
        for l in open(sys.argv[1]) if "serve decode step" in l]
n = len(rows)
fresh = sum(r.get("fresh") == "true" for r in rows)
rep = sum(r.get("replayed") == "true" for r in rows)
print(f"{n} decode steps: {fresh} planned afresh, {rep} replayed" if n else "no step events")' "$1"
}
for build in new base; do
  bin=$BIN
  [ $build = base ] && bin=.device/canopy-base
  [ "$(left)" -lt 90 ] && { log "SKIPPED $build (time)"; continue; }
  RUST_LOG=canopy_runtime=debug $bin serve --port 0 --arch llama-3.1-8b --random-weights \
    --backend cuda --method auto --max-context 20480 --kv-tokens 131072 --max-batch "$C" \
    > "$R/server-$build.log" 2>&1 &
  server=$!
  url=
  while [ -z "$url" ] && kill -0 $server 2>/dev/null; do
    sleep 0.5
    url=$(grep -o 'listening on http://[0-9.:]*' "$R/server-$build.log" | head -1 | cut -d' ' -f3)
  done
  [ -z "$url" ] && { log "server $build died"; tail -5 "$R/server-$build.log"; continue; }
  timeout 120 $bin bench serve --url "$url" --json --dataset few-shot --prefix-len 512 \
    --num-prompts 8 --output-len 8 > /dev/null
  for d in ${DATASETS:-few-shot multi-doc}; do
    log "$build $d"
    timeout 150 $bin bench serve --url "$url" --json --dataset "$d" --num-prompts 128 \
      --max-concurrency "$C" --output-len 128 --seed 0 > "$R/bench-$build-$d.json"
    python3 - "$R/bench-$build-$d.json" <<'PY'
import json, sys
x = json.load(open(sys.argv[1]))
d, s = x.get("decode") or {}, x.get("steps") or {}
full = [b for b in d.get("by_rows", []) if b["rows"] == max(r["rows"] for r in d["by_rows"])]
f = full[0] if full else {}
print(f"out tok/s {x['output_throughput']:.1f}  step {s.get('mean_step_ms', 0):.2f} ms  "
      f"decode pass {d.get('mean_ms', 0):.2f} ms  at {f.get('rows')} rows {f.get('mean_ms', 0):.2f} ms "
      f"(floor {f.get('floor_ms', 0):.2f}, x{f.get('vs_floor', 0):.2f})")
PY
  done
  kill -TERM $server; wait $server 2>/dev/null
  steps "$R/server-$build.log"
done 2>&1 | tee "$OUT/serve-log.txt"
tar czf "$OUT/serve.tgz" -C "$OUT" serve
[ "$(left)" -gt 100 ] && NS=${NS:-1 64} bash "$(dirname "$0")/profile-batch.sh"
