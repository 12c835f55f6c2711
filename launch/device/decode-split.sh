#!/usr/bin/env bash
# `generate`'s sequence-parallel prefill on ranks of one GPU against a base build: `bench
# decode` on the 8B shape with random weights (prefill chunks of 8K, so a piece is 16K tokens
# at 2 ranks), contexts CONTEXTS (default 16K,32K), at RANKS ranks (default 1,2), STRATEGIES
# (default tree,ring), with each binary of BINS (name=path; default new=.device/canopy base=.device/canopy-base), in
# turn, ROUNDS rounds (default 2, the binaries in the other order in even rounds): each row's
# prefill seconds and decode ms/token. Run from the repository root on the device machine.
# Results: $OUT/decode-split.txt and $OUT/NAME-rROUND.json.
set -uo pipefail
source "$(dirname "$0")/env.sh"
DEADLINE=${DEADLINE:-540}
BINS=${BINS:-new=.device/canopy base=.device/canopy-base}
CONTEXTS=${CONTEXTS:-16K,32K}
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  for round in $(seq "${ROUNDS:-2}"); do
    order=$BINS
    [ $((round % 2)) = 0 ] && order=$(echo $BINS | tr ' ' '\n' | tac | tr '\n' ' ')
    for entry in $order; do
      name=${entry%%=*} bin=${entry#*=}
      [ "$(left)" -lt 90 ] && { log "stopped: $(left) s left"; break 2; }
      log "round $round, $name"
      json=$OUT/$name-r$round.json
      timeout $(( DEADLINE - SECONDS )) $bin bench decode --arch llama-3.1-8b --random-weights \
        --backend cuda --context "$CONTEXTS" --ranks "${RANKS:-1,2}" --strategy "${STRATEGIES:-tree,ring}" --decode 10 \
        --json > "$json" 2> "${json%.json}.err" || tail -3 "${json%.json}.err"
      python3 -c 'import json, sys
for x in json.load(open(sys.argv[1]))["rows"]:
    print(sys.argv[2], "ranks", x["ranks"], x["strategy"], "context", x["context"], "prefill %.3f s" % x["fill_s"], "decode %.2f ms/token" % x["decode_ms_per_token"])' "$json" "$name"
    done
  done
} 2>&1 | tee "$OUT/decode-split.txt"
