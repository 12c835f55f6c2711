#!/usr/bin/env bash
# The model's ring hand-off (nvidia-h100-x2 or larger): `bench decode` of Llama-3.1-8B (random
# weights and context, threads, G ranks, one per GPU) with the ring for every binary of BINS
# ("name=path ..."), CONTEXTS, ROUNDS rounds alternating the binaries, the tree once beside
# them; then model-check's ring cases on G ranks (first binary) against transformers and one
# rank. Results: $OUT/ring.jsonl (a line per row), log.txt, model-check-log.txt.
set -uo pipefail
source "$(dirname "$0")/env.sh"
BINS=${BINS:-new=$BIN}
CONTEXTS=${CONTEXTS:-32K,128K,256K}
G=${G:-$(nvidia-smi --list-gpus | wc -l)}
DEADLINE=${DEADLINE:-540}
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  row() { # name strategy round
    local name=$1 strategy=$2 round=$3 bin
    for entry in $BINS; do [ "${entry%%=*}" = "$name" ] && bin=${entry#*=}; done
    [ "$(left)" -lt 60 ] && { echo "SKIPPED $name $strategy round $round (time)"; return; }
    log "$name: $strategy at $G ranks, $CONTEXTS (round $round)"
    $bin bench decode --arch llama-3.1-8b --random-weights --context-fill random --decode 10 \
      --context "$CONTEXTS" --ranks "$G" --strategy "$strategy" --json 2> "$OUT/$name-$strategy-$round.err" \
      | python3 -c 'import json,sys
r=json.load(sys.stdin); n,s,k=sys.argv[1:4]
for x in r["rows"]:
    print(json.dumps(dict(bin=n, strategy=s, round=int(k), context=x["context"], ranks=x["ranks"],
        ms=round(x["decode_ms_per_token"], 2), floor_ms=round(x.get("floor_ms") or 0, 2))))' "$name" "$strategy" "$round" \
      | tee -a "$OUT/ring.jsonl" || echo "FAILED $name $strategy round $round"
  }
  first=${BINS%% *}; first=${first%%=*}
  for round in $(seq "${ROUNDS:-2}"); do
    for entry in $BINS; do row "${entry%%=*}" ring "$round"; done
  done
  row "$first" tree 1
  log "model-check: ring and tree on $G ranks ($first)"
  STAGES="fixtures device" FIXTURE_CASES="f32:$G:ring bf16:$G:ring bf16:1:ring" TINY_CASES="bf16:$G:ring" \
    BIG_CASES="bf16:$G:ring" DEADLINE=$(($(left) - 10)) \
    bash "$(dirname "$0")/model-check.sh" > "$OUT/model-check-log.txt" 2>&1
  tail -4 "$OUT/model-check-log.txt"
} 2>&1 | tee "$OUT/log.txt"
