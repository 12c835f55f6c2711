#!/usr/bin/env bash
# The multi-GPU runs (nvidia-h200-x2 or -x4): the model over every GPU of the machine, G of
# them; the tables run at 1 and every power of two up to G ranks (RANKS: 1,2,4 on four).
# PART lists the parts to run, in order (PART="check prefill scaling"); each writes under
# $OUT/PART and is one call's worth or less (well inside 10 minutes):
#   check   the model runtime's correctness with a GPU per rank (NCCL): model-check.sh's
#           fixture cases on 1 and G ranks, tree and ring, f32 and bf16, against transformers'
#           references and one rank.
#   decode  `bench decode` of Llama-3.1-8B with random weights and a random context, threads:
#           32K…256K at RANKS, tree (auto) against the ring; every collective at G ranks; 1M
#           at G ranks (1M does not fit one H200 beside the weights); then, on 3 GPUs or more,
#           `bench decode --predict G` from the rows at fewer ranks beside the G-rank rows.
#   mpi     the same model under `mpirun -np G` (one process per GPU), tree and ring, 32K and
#           1M; then the longest context the G GPUs hold (LONGEST tokens, else 99.5% of the
#           decode part's capacity) through `canopy generate --context-fill random`.
#   scaling `bench scaling` of the attention engine at RANKS (the Llama shape, 128K…4M), with
#           its prediction for 8 GPUs.
#   serve   `canopy serve --ranks G`: one long-document request (DOC tokens) sharded over the
#           GPUs, then `bench serve` (multi-doc) beside it.
#   prefill Table 1 with the prefill included: `bench decode` with a real prefill at
#           PREFILL_CONTEXTS, RANKS, tree and ring; then `canopy generate --context
#           PREFILL_LONG` (a real prefill) at G ranks.
# Run from the repository root with the release binary (built with --features mpi) in
# $DIR/canopy. DEADLINE (seconds, default 570) caps every step's time limit at what is left,
# and a part that would start with under a minute left is skipped. Results: $OUT/log.txt and
# $OUT/parts.tgz (JSON, CSV, plots, servers' logs).
set -uo pipefail
DIR=${DIR:-.device}
export CANOPY_BIN=$DIR/canopy
source "$(dirname "$0")/env.sh"
PARTS=(${PART:-check decode})
for part in "${PARTS[@]}"; do mkdir -p "$OUT/$part"; done
trap 'tar czf "$OUT/parts.tgz" -C "$OUT" "${PARTS[@]}" && (cd "$OUT" && rm -rf "${PARTS[@]}")' EXIT
DEADLINE=${DEADLINE:-570}
# limit SECONDS: that, or the seconds left before DEADLINE if fewer.
limit() { local l; l=$(left); echo $(($1 < l ? $1 : l)); }
# G may be set to run G ranks on fewer GPUs (a smoke test of the parts on one GPU).
G=${G:-$(nvidia-smi --list-gpus | wc -l)}
# The rank counts of the tables: 1 and every power of two up to G (1,2,4 on four GPUs).
RANKS=1
for ((r = 2; r <= G; r *= 2)); do RANKS=$RANKS,$r; done
ARCH=(--arch llama-3.1-8b --random-weights)
MPIRUN=(mpirun --allow-run-as-root -np "$G" -x NCCL_NVLS_ENABLE -x LD_LIBRARY_PATH -x CANOPY_KERNEL_CACHE)

# decode NAME LIMIT ARGS...: `bench decode` on the 8B shape, its report in NAME.json, the
# rows in NAME.csv, its plot in NAME.png; the tables on the log.
decode() {
  local name=$1 limit=$2
  shift 2
  log "bench decode $name: $*"
  timeout "$(limit "$limit")" "$@" --json --csv "$R/$name.csv" > "$R/$name.json" || log "FAILED or cut off: $name"
  python3 - "$R/$name.json" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as e:
    sys.exit(f"no report: {e}")
print(f"{r['model']} ({r['dtype']}), {r['devices']} device(s), copy {r['copy_bandwidth_gb_s']:.0f} GB/s, GEMM {r['gemm_tflops']:.0f} TFLOP/s")
for c in r["capacity"]:
    print(f"  longest context at {c['ranks']} rank(s), {c['context_fill']}: {c['longest_context']} ({c['bound_by']})")
print(f"{'context':>8} {'P':>2} {'strategy':>16} {'fill s':>8} {'TTFT s':>8} {'total s':>8} {'ms/token':>9} {'floor ms':>9} {'x floor':>8} {'merge ms/l':>10} {'peak GB':>8}")
for x in r["rows"]:
    f = lambda v, fmt: format(v, fmt) if v is not None else "-"
    print(f"{x['context']:>8} {x['ranks']:>2} {x['strategy']:>16} {x['fill_s']:>8.2f} {x['ttft_s']:>8.2f} {x['total_s']:>8.2f} "
          f"{f(x['decode_ms_per_token'], '9.2f')} {f(x['floor_ms'], '9.2f')} {f(x['vs_floor'], '8.2f')} "
          f"{f(x['merge_ms_per_layer'], '10.3f')} {f(x['peak_bytes'] and x['peak_bytes'] / 1e9, '8.1f')}")
PY
}

{
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
  nvidia-smi topo -m
  for PART in "${PARTS[@]}"; do
    R=$OUT/$PART
    if [ "$(left)" -lt 60 ]; then log "skipped $PART: $(left) s left"; continue; fi
    case $PART in
    check)
      log "model-check: the tiny fixtures on 1 and $G ranks (one GPU each: NCCL)"
      OUT=$R/check STAGES=fixtures DEADLINE=$(limit ${CHECK_DEADLINE:-110}) \
        FIXTURE_CASES="f32:1:tree f32:$G:tree f32:$G:ring bf16:1:tree bf16:$G:tree bf16:$G:ring" \
        bash "$(dirname "$0")/model-check.sh" > /dev/null 2>&1
      tail -1 "$R/check/model-check-log.txt"
      ;;
    decode)
      decode table 300 $BIN bench decode "${ARCH[@]}" --context-fill random --decode 10 \
        --context 32K,64K,128K,256K --ranks "$RANKS" --strategy tree,ring --plot "$R/table.png"
      decode collectives 120 $BIN bench decode "${ARCH[@]}" --context-fill random --decode 10 \
        --context 32K,256K --ranks "$G" --collective allreduce3,allreduce2,allgather
      decode million 150 $BIN bench decode "${ARCH[@]}" --context-fill random --decode 10 \
        --context 1M --ranks "$G" --strategy tree,ring
      # The G-rank rows beside the model fitted to the rows at fewer ranks (3 GPUs or more).
      if [ "$G" -ge 3 ]; then
        log "the decode model at $G ranks, fitted to fewer, beside the $G-rank rows"
        $BIN bench decode --from "$R/table.json,$R/million.json" --predict "$G" \
          | tee "$R/predicted.txt" || log "FAILED: the prediction"
      fi
      ;;
    mpi)
      decode mpi 150 "${MPIRUN[@]}" $BIN bench decode "${ARCH[@]}" --context-fill random \
        --decode 10 --context 32K,1M --strategy tree,ring
      # The longest context: LONGEST, else 99.5% of what the decode part priced at G ranks.
      longest=${LONGEST:-$(python3 -c "
import json, sys
r = json.load(open(sys.argv[1]))
print(next(int(c['longest_context'] * 0.995) for c in r['capacity'] if c['ranks'] == int(sys.argv[2])))
      " "$OUT/decode/table.json" "$G" 2>/dev/null)}
      if [ -z "$longest" ]; then log "no LONGEST and no capacity from the decode part"; continue; fi
      log "generate: the longest context, $longest tokens, on $G GPUs, random fill"
      timeout "$(limit 240)" $BIN generate "${ARCH[@]}" --ranks "$G" --context "$longest" \
        --context-fill random --max-tokens 16 --json > "$R/longest.json" || log "FAILED or cut off: longest"
      python3 -c "
import json, sys
d = json.load(open(sys.argv[1]))
print({k: d[k] for k in ('ranks', 'strategy', 'prompt_tokens', 'prefill_s', 'ttft_s', 'decode_ms_per_token')})
      " "$R/longest.json"
      ;;
    scaling)
      log "bench scaling, the Llama shape, threads"
      timeout "$(limit 150)" $BIN bench scaling --backend cuda --ranks "$RANKS" --heads 32 --kv-heads 8 \
        --head-dim 128 --dtype bf16 --seq-lens 131072,1048576,4194304 --iters 10 \
        --check-max-tokens 1048576 --csv "$R/scaling.csv" --json > "$R/scaling.json" \
        || log "FAILED or cut off: scaling"
      $BIN bench scaling --from "$R/scaling.json" --predict 8 --seq-lens 2097152,5242880
      ;;
    serve)
      DOC=${DOC:-65536}
      $BIN serve "${ARCH[@]}" --backend cuda --ranks "$G" --max-context $((DOC + 1024)) \
        --kv-tokens $((4 * DOC)) --port 0 > "$R/server.log" 2>&1 &
      server=$!
      url=
      until [ -n "$url" ] || ! kill -0 $server 2>/dev/null; do
        sleep 0.5
        url=$(grep -o 'listening on http://[0-9.:]*' "$R/server.log" | head -1 | cut -d' ' -f3)
      done
      log "server at ${url:-nowhere}"
      timeout "$(limit 200)" python3 - "$url" "$DOC" <<'PY' | tee "$R/long-document.txt"
import json, sys, time, urllib.request
url, n = sys.argv[1], int(sys.argv[2])
# The stand-in tokenizer reads one token per character.
doc = "".join(chr(ord("a") + (i * 7919) % 26) for i in range(n - 64))
def ask(q, max_tokens):
    body = json.dumps({"prompt": doc + q, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    t = time.time()
    out = json.load(urllib.request.urlopen(req, timeout=180))
    return time.time() - t, out["usage"]
for q in (" first question?", " second question?"):
    s, usage = ask(q, 32)
    print(f"long document: {usage['prompt_tokens']} prompt tokens, {usage['completion_tokens']} generated, {s:.2f} s end to end")
PY
      log "bench serve multi-doc against the same server"
      timeout "$(limit 200)" $BIN bench serve --url "$url" --dataset multi-doc --num-prompts 64 \
        --max-concurrency 16 --output-len 64 --json > "$R/bench-multi-doc.json" || log "FAILED or cut off: bench serve"
      python3 -c "
import json, sys
d = json.load(open(sys.argv[1]))
print(json.dumps({k: v for k, v in d.items() if not isinstance(v, (list, dict))}, indent=1))
      " "$R/bench-multi-doc.json"
      curl -s "$url/metrics" > "$R/metrics.txt"
      kill -TERM $server; wait $server
      ;;
    prefill)
      decode prefill 420 $BIN bench decode "${ARCH[@]}" --decode 10 \
        --context "${PREFILL_CONTEXTS:-32K,64K,120K}" --ranks "$RANKS" --strategy tree,ring
      log "generate: a real prefill of ${PREFILL_LONG:-127K} tokens on $G GPUs"
      timeout "$(limit 150)" $BIN generate "${ARCH[@]}" --ranks "$G" --context "${PREFILL_LONG:-127K}" \
        --max-tokens 10 --json > "$R/prefill-long.json" || log "FAILED or cut off: prefill-long"
      ;;
    *) log "no part $PART" ;;
    esac
  done
} 2>&1 | tee "$OUT/log.txt"
