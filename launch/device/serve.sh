#!/usr/bin/env bash
# Issue 24, serving on one GPU: `canopy serve --arch llama-3.1-8b --random-weights` started once
# with tree-planned attention (`--method auto`) and once with per-request attention
# (`--method q-guided`), and `canopy bench serve` against each on every shared-prefix dataset
# at the same concurrency. The few-shot run (a 4K shared prefix, CONCURRENCY requests at once)
# is also the batch-64 decode step beside its floor. Then, beside them: a 16K few-shot prefix
# with both methods, and short random prompts (a decode pass that is nearly all weights) with
# auto. First, a check that serving on the GPU gives what `canopy generate` on the CPU gives
# (the tiny fixture model, f32, on CHECK_RANKS ranks: 1 by default).
#
# Run from the repository root on the device machine with the release binary in $DIR/canopy
# (DIR defaults to .device). CONCURRENCY, PROMPTS, OUTPUT_LEN, DATASETS, MODEL (the serve
# options naming the model and backend), MAX_CONTEXT, KV_TOKENS and LENGTHS (extra dataset
# options) narrow the run;
# sections stop being started DEADLINE seconds in (default 480). Results: $OUT/serve-log.txt
# and $OUT/serve.tgz (bench-METHOD-DATASET.json, the servers' logs, check.txt).
set -uo pipefail
DIR=${DIR:-.device}
CANOPY_BIN=$DIR/canopy
source "$(dirname "$0")/env.sh"
R=$OUT/serve
mkdir -p "$R"
SERVER_LOGS=$R
trap 'tar czf "$OUT/serve.tgz" -C "$OUT" serve' EXIT
C=${CONCURRENCY:-64}
N=${PROMPTS:-128}
O=${OUTPUT_LEN:-128}
DATASETS=${DATASETS:-few-shot multi-doc multi-chain system-prompt}
MODEL=${MODEL:---arch llama-3.1-8b --random-weights --backend cuda}
LENGTHS=${LENGTHS:-}
KV_TOKENS=${KV_TOKENS:-131072}
MAX_CONTEXT=${MAX_CONTEXT:-20480}
DEADLINE=${DEADLINE:-480}
TINY=tests/fixtures/tiny/gqa-hd64


# bench NAME LIMIT ARGS...: `canopy bench serve` against $URL, its report in bench-NAME.json.
bench() {
  local name=$1 limit=$2
  shift 2
  timeout "$limit" $BIN bench serve --url "$URL" --json "$@" > "$R/bench-$name.json" \
    || log "FAILED or cut off: $name"
}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  log "check: the tiny model served on the GPU (f32) against canopy generate on the CPU"
  if start_server tiny --model $TINY --backend cuda --dtype f32 --max-batch 12 --prefill-chunk 64 \
    --ranks "${CHECK_RANKS:-1}"; then
    timeout 120 python3 - "$URL" "$BIN" "$TINY" <<'PY' 2>&1 | tee "$R/check.txt"
import json, subprocess, sys, urllib.request
from concurrent.futures import ThreadPoolExecutor
url, canopy, tiny = sys.argv[1:]
prompts = [p["token_ids"] for p in json.load(open(f"{tiny}/reference.json"))["prompts"]]
def served(ids):
    body = json.dumps({"prompt": ids, "max_tokens": 24, "temperature": 0}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req))["choices"][0]["text"]
def alone(ids):
    out = subprocess.run([canopy, "generate", "--model", tiny, "--backend", "cpu", "--json",
                          "--prompt-ids", ",".join(map(str, ids)), "--max-tokens", "24"],
                         capture_output=True, check=True).stdout
    return json.loads(out)["samples"][0]["text"]
with ThreadPoolExecutor(12) as pool:
    got = list(pool.map(served, prompts * 3))
want = [alone(p) for p in prompts] * 3
bad = sum(g != w for g, w in zip(got, want))
print(f"check: {len(got) - bad}/{len(got)} served texts equal generate's on the CPU")
PY
    stop_server
  fi

  for method in auto q-guided; do
    [ "$(left)" -lt 60 ] && { log "SKIPPED $method (time)"; continue; }
    log "server: $MODEL --method $method"
    start_server "$method" $MODEL --method "$method" --max-context "$MAX_CONTEXT" --kv-tokens "$KV_TOKENS" \
      --max-batch "$C" || continue
    # Warm-up: the kernels this method runs are compiled on first use.
    bench "$method-warmup" 120 --dataset few-shot --prefix-len 512 --num-prompts 8 --output-len 8
    for d in $DATASETS; do
      [ "$(left)" -lt 30 ] && { log "SKIPPED $method $d (time)"; continue; }
      log "bench $method $d"
      bench "$method-$d" 150 --dataset "$d" --num-prompts "$N" --max-concurrency "$C" \
        --output-len "$O" --seed 0 $LENGTHS
    done
    if [ -z "$LENGTHS" ] && [ "$(left)" -gt 60 ]; then
      log "bench $method few-shot-16k"
      bench "$method-few-shot-16k" 150 --dataset few-shot --prefix-len 16384 --num-prompts "$C" \
        --max-concurrency "$C" --output-len "$O" --seed 0
    fi
    if [ -z "$LENGTHS" ] && [ $method = auto ] && [ "$(left)" -gt 30 ]; then
      log "bench $method short-random"
      bench "$method-short-random" 100 --dataset random --input-len 16 --num-prompts "$C" \
        --max-concurrency "$C" --output-len "$O" --seed 0
    fi
    stop_server
  done

  log "summary"
  python3 - "$R" <<'PY'
import json, os, sys
r = sys.argv[1]
def load(n):
    p = os.path.join(r, f"bench-{n}.json")
    try:
        return json.load(open(p))
    except Exception:
        return None
print(f"{'dataset':14} {'method':9} {'done':>5} {'s':>6} {'out tok/s':>9} {'TTFT med':>9} {'TPOT med':>9} "
      f"{'ITL p99':>8} {'hit':>6} {'rows':>5} {'ms/pass':>8}")
for d in "few-shot multi-doc multi-chain system-prompt few-shot-16k short-random".split():
    rates = {}
    for m in ("auto", "q-guided"):
        x = load(f"{m}-{d}")
        if not x:
            continue
        rates[m] = x["output_throughput"]
        dec = x.get("decode") or {}
        print(f"{d:14} {m:9} {x['completed']:>5} {x['duration_s']:>6.2f} {x['output_throughput']:>9.1f} "
              f"{x['ttft_ms']['median']:>9.1f} {x['tpot_ms']['median']:>9.2f} {x['itl_ms']['p99']:>8.2f} "
              f"{100 * (x['prefix_cache_hit_rate'] or 0):>5.1f}% {dec.get('mean_rows', 0):>5.1f} {dec.get('mean_ms', 0):>8.2f}")
    if len(rates) == 2:
        print(f"{d:14} auto / q-guided output throughput: {rates['auto'] / rates['q-guided']:.2f}x")
for d in "few-shot multi-doc multi-chain system-prompt few-shot-16k short-random".split():
    for m in ("auto", "q-guided"):
        x = load(f"{m}-{d}")
        st = x and x.get("steps")
        if st:
            print(f"{d:14} {m:9} {st['busy_steps']} steps of {st['mean_step_ms']:.2f} ms: decode {100 * st['decode_share']:.0f}%, "
                  f"prefill {100 * st['prefill_share']:.0f}% ({st['prefill_tokens']} at {st['prefill_tokens_per_s'] or 0:.0f}/s), "
                  f"rest {100 * st['other_share']:.0f}%")
for d, m in [(d, m) for d in ("few-shot", "few-shot-16k", "short-random") for m in ("auto", "q-guided")]:
    x = load(f"{m}-{d}")
    if not x or not x.get("decode"):
        continue
    dec = x["decode"]
    print(f"{d} {m}: copy {dec['copy_bandwidth_gb_s']} GB/s, weights {dec['weight_bytes'] / 1e9:.2f} GB")
    for p in dec["by_rows"][:3]:
        print(f"  rows {p['rows']:>3}: {p['passes']:>4} passes, {p['mean_ms']:.2f} ms, KV {p['mean_kv_bytes'] / 1e6:.1f} MB, "
              f"floor {p['floor_ms']} ms, x floor {p['vs_floor']}")
PY
} 2>&1 | tee "$OUT/serve-log.txt"
