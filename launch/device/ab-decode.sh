#!/usr/bin/env bash
# A/B of whole binaries on `bench decode` (random weights and context, one rank, tree): every
# binary in BINS ("name=path ...", default this build against .device/canopy-base; a path may
# end in @ and one flag of bench decode, e.g. eager=.device/canopy@--eager) on every
# shape in ARCHS at CONTEXTS (a shape may name its own, as smollm2-135m:4096,8000), ROUNDS
# times in turn so drift shows; DECODE tokens each (20; 150 or more covers a leaf's growth room
# several times, and the mean step counts the replans).
# Each binary keeps its own kernel cache. Results: $OUT/ab.jsonl (one line per row), log.txt,
# and stderr.log (the stderr of each run that wrote any, under its name, shape and round).
set -uo pipefail
source "$(dirname "$0")/env.sh"
BINS=${BINS:-new=$BIN base=.device/canopy-base}
DEADLINE=${DEADLINE:-520}
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  for round in $(seq "${ROUNDS:-2}"); do
    for case in ${ARCHS:-llama-3.1-8b llama-3.2-1b}; do
      arch=${case%%:*} contexts=${CONTEXTS:-8K,32K}
      [ "$arch" = "$case" ] || contexts=${case#*:}
      for entry in $BINS; do
        name=${entry%%=*} bin=${entry#*=} flag=
        case $bin in *@*) flag=${bin#*@} bin=${bin%%@*} ;; esac
        [ $SECONDS -gt "$DEADLINE" ] && { echo "SKIPPED $name $arch round $round (time)"; continue; }
        CANOPY_KERNEL_CACHE=/tmp/canopy-kernels-$name $bin bench decode --arch "$arch" \
          --random-weights --context-fill random --context "$contexts" --ranks 1 \
          --strategy tree --decode "${DECODE:-20}" $flag --json 2> "$OUT/run.err" \
          | python3 -c 'import json,sys
r=json.load(sys.stdin); b,a,k=sys.argv[1:4]
for x in r["rows"]:
    print(json.dumps(dict(bin=b, arch=a, round=int(k), context=x["context"], ms=x["decode_ms_per_token"],
                          mean_ms=x.get("decode_mean_ms_per_token"), floor=x["floor_ms"],
                          replayed=x.get("replayed_steps"))))' "$name" "$arch" "$round" \
          | tee -a "$OUT/ab.jsonl" || echo "FAILED $name $arch round $round"
        [ -s "$OUT/run.err" ] && { echo "== $name $arch round $round"; cat "$OUT/run.err"; } >> "$OUT/stderr.log"
        rm -f "$OUT/run.err"
      done
    done
  done
} 2>&1 | tee "$OUT/log.txt"
