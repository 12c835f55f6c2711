#!/usr/bin/env bash
# A/B of whole binaries on the prefill (issue 23): the layer-op tests of the prefill's attention
# first (.device/layer_ops, built from the first binary's sources), then `bench decode` with a
# real prefill of the Llama-3.1-8B shape (random bf16 weights, one rank, chunks of CHUNK,
# default 8K) for every binary in BINS ("name=path ..."; a path may end in +DIR, a folder of
# kernel sources the binary then compiles instead of its own, CANOPY_KERNEL_SOURCES), in turn:
# CONTEXTS in the first round, the first context again in each later round (ROUNDS), so drift
# shows. Results: $OUT/ab.jsonl (one line per row) and log.txt.
set -uo pipefail
source "$(dirname "$0")/env.sh"
BINS=${BINS:-new=$BIN base=.device/canopy-base}
CONTEXTS=${CONTEXTS:-32K,127K}
DEADLINE=${DEADLINE:-540}
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  log "layer-op tests: the prefill's attention"
  .device/layer_ops --test-threads 1 stored_kv 2>&1 | grep -E "^test |test result|panicked"
  # run ENTRY ARGS...: the entry's binary with its sources, if it names any.
  run() {
    local bin=${1#*=} sources=
    case $bin in *+*) sources=${bin#*+} bin=${bin%%+*} ;; esac
    shift
    env ${sources:+CANOPY_KERNEL_SOURCES=$sources} $bin "$@"
  }
  for entry in $BINS; do
    run "$entry" compile-kernels > /dev/null 2>&1 || echo "compile-kernels FAILED: ${entry%%=*}"
  done
  for round in $(seq "${ROUNDS:-2}"); do
    contexts=$CONTEXTS
    [ "$round" -gt 1 ] && contexts=${CONTEXTS%%,*}
    for entry in $BINS; do
      name=${entry%%=*}
      [ "$(left)" -lt 45 ] && { echo "SKIPPED $name round $round (time)"; continue; }
      log "$name, round $round: prefill $contexts"
      run "$entry" bench decode --arch llama-3.1-8b --random-weights --context "$contexts" --ranks 1 \
        --strategy tree --decode 3 --prefill-chunk "${CHUNK:-8K}" --json 2> "$OUT/$name-$round.err" \
        | python3 -c 'import json,sys
r=json.load(sys.stdin); b,k=sys.argv[1:3]
for x in r["rows"]:
    print(json.dumps(dict(bin=b, round=int(k), context=x["context"], prefill_s=round(x["fill_s"], 4),
        tflops=round(x["prefill_tflops_per_device"], 1), peak_gib=round((x["peak_bytes"] or 0) / 2**30, 1))))' "$name" "$round" \
        | tee -a "$OUT/ab.jsonl" || echo "FAILED $name round $round"
    done
  done
} 2>&1 | tee "$OUT/log.txt"
