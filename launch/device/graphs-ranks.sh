#!/usr/bin/env bash
# Decode steps of several ranks recorded as CUDA graphs, the tree's cross-rank merge (NCCL)
# inside them (needs G >= 2 GPUs, one rank each):
#   replay  the tiny fixtures through `canopy generate` at G ranks, graphs against --eager
#           (bf16, 60 tokens; greedy, and 3 samples at temperature 0.9): every step's top two
#           logits and every sample's tokens must be the same bits;
#   check   model-check.sh's fixture cases, tree at 1 and G ranks, against transformers;
#   decode  `bench decode` of the 8B shape (random weights and context), tree at 1..G ranks
#           with graphs, and --eager at G ranks beside them; then the same under
#           `mpirun -np G`;
#   serve   `canopy serve --ranks G` with graphs and with --eager, `bench serve` multi-doc
#           against each after a warm-up (a batch whose rows come and go: recordings are made
#           and dropped with every rank agreeing).
# PART lists the parts (default: all, in that order). Results: $OUT/log.txt, $OUT/parts.tgz.
set -uo pipefail
source "$(dirname "$0")/env.sh"
G=${G:-$(nvidia-smi --list-gpus | wc -l)}
DEADLINE=${DEADLINE:-560}
limit() { local l; l=$(left); echo $(($1 < l ? $1 : l)); }
RANKS=1
for ((r = 2; r <= G; r *= 2)); do RANKS=$RANKS,$r; done
ARCH=(--arch llama-3.1-8b --random-weights)
PARTS=(${PART:-replay check decode serve})
R=$OUT/parts
mkdir -p "$R"
trap 'tar czf "$OUT/parts.tgz" -C "$OUT" parts && rm -rf "$R"' EXIT
{
  nvidia-smi --query-gpu=index,name --format=csv,noheader
  for part in "${PARTS[@]}"; do
    if [ "$(left)" -lt 40 ]; then log "skipped $part: $(left) s left"; continue; fi
    case $part in
    replay)
      log "replay equals eager at $G ranks (NCCL), the tiny fixtures"
      for v in gqa-hd64 llama3-hd128 tied-mha-hd64; do
        for s in "1 0" "3 0.9"; do
          set -- $s
          for mode in graphs eager; do
            flag=; [ $mode = eager ] && flag=--eager
            timeout "$(limit 60)" $BIN generate --model "tests/fixtures/tiny/$v" --backend cuda \
              --dtype bf16 --ranks "$G" --prompt-ids 5,42,79,116,153,190,227,264,301,18,55 \
              --max-tokens 60 --n "$1" --temperature "$2" --seed 7 --json --logits $flag \
              > "$R/replay-$v-n$1-$mode.json" 2> "$R/replay-$v-n$1-$mode.log" \
              || log "FAILED or cut off: $v n=$1 $mode"
          done
          python3 - "$R/replay-$v-n$1-graphs.json" "$R/replay-$v-n$1-eager.json" "$v n=$1" <<'PY'
import json, sys
try:
    g, e = (json.load(open(p)) for p in sys.argv[1:3])
except Exception as x:
    sys.exit(print(f"{sys.argv[3]}: no output ({x})"))
same_tokens = [s["tokens"] for s in g["samples"]] == [s["tokens"] for s in e["samples"]]
gs, es = g["logits"]["steps"], e["logits"]["steps"]
same_logits = json.dumps(gs) == json.dumps(es)
print(f"{sys.argv[3]}: {len(gs)} steps ({g['replayed_steps']} replayed, {e['replayed_steps']} with --eager), "
      f"tokens {'same' if same_tokens else 'DIFFER'}, top two logits {'same bits' if same_logits else 'DIFFER'}")
PY
        done
      done
      grep -h "op by op" "$R"/replay-*-graphs.log | sort | uniq -c
      ;;
    check)
      log "model-check: the fixtures' tree on 1 and $G ranks"
      OUT=$R/check STAGES=fixtures DEADLINE=$(limit 110) \
        FIXTURE_CASES="f32:1:tree f32:$G:tree bf16:1:tree bf16:$G:tree" \
        bash "$(dirname "$0")/model-check.sh" > /dev/null 2>&1
      tail -1 "$R/check/model-check-log.txt"
      ;;
    decode)
      log "bench decode, tree, graphs at $RANKS ranks"
      timeout "$(limit 150)" $BIN bench decode "${ARCH[@]}" --context-fill random --decode 20 \
        --context 32K,256K --ranks "$RANKS" --strategy tree --json > "$R/graphs.json" \
        || log "FAILED or cut off: graphs"
      log "bench decode, tree, --eager at $G ranks"
      timeout "$(limit 90)" $BIN bench decode "${ARCH[@]}" --context-fill random --decode 20 \
        --context 32K,256K --ranks "$G" --strategy tree --eager --json > "$R/eager.json" \
        || log "FAILED or cut off: eager"
      log "bench decode, tree, mpirun -np $G"
      timeout "$(limit 90)" mpirun --allow-run-as-root -np "$G" -x NCCL_NVLS_ENABLE -x LD_LIBRARY_PATH \
        -x CANOPY_KERNEL_CACHE $BIN bench decode "${ARCH[@]}" --context-fill random --decode 20 \
        --context 32K,1M --strategy tree --json > "$R/mpi.json" || log "FAILED or cut off: mpi"
      python3 - "$R"/graphs.json "$R"/eager.json "$R"/mpi.json <<'PY'
import json, sys
for path in sys.argv[1:]:
    try:
        r = json.load(open(path))
    except Exception as e:
        print(f"{path}: no report ({e})"); continue
    print(f"{path.split('/')[-1]}: copy {r['copy_bandwidth_gb_s']:.0f} GB/s")
    for x in r["rows"]:
        print(f"  {x['context']:>8} P={x['ranks']} {x['strategy']:>10} {x['decode_ms_per_token']:7.2f} ms/token "
              f"floor {x['floor_ms']:6.2f} ({x['vs_floor']:.2f}x)")
PY
      ;;
    serve)
      for mode in graphs eager; do
        flag=; [ $mode = eager ] && flag=--eager
        $BIN serve "${ARCH[@]}" --backend cuda --ranks "$G" --max-context 66560 \
          --kv-tokens 262144 --port 0 $flag > "$R/server-$mode.log" 2>&1 &
        server=$! url=
        until [ -n "$url" ] || ! kill -0 $server 2>/dev/null; do
          sleep 0.5
          url=$(grep -o 'listening on http://[0-9.:]*' "$R/server-$mode.log" | head -1 | cut -d' ' -f3)
        done
        log "$mode server at ${url:-nowhere}: a warm-up, then bench serve multi-doc"
        timeout "$(limit 60)" $BIN bench serve --url "$url" --dataset multi-doc --num-prompts 4 \
          --max-concurrency 4 --output-len 8 --seed 1 --json > /dev/null 2>&1
        timeout "$(limit 120)" $BIN bench serve --url "$url" --dataset multi-doc --num-prompts 64 \
          --max-concurrency 16 --output-len 64 --json > "$R/bench-$mode.json" || log "FAILED or cut off: bench serve"
        python3 -c "
import json, sys
d = json.load(open(sys.argv[1]))
print(sys.argv[2], {k: d[k] for k in ('completed', 'failed', 'duration_s', 'output_throughput', 'prefix_cache_hit_rate')})
        " "$R/bench-$mode.json" $mode
        kill -TERM $server; wait $server
        grep -h "op by op" "$R/server-$mode.log" | head -3
      done
      ;;
    esac
  done
} 2>&1 | tee "$OUT/log.txt"
