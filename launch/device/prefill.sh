#!/usr/bin/env bash
# Issue 23, the prefill's attention on tensor cores (`prefill.cu`): the layer-op tests (the
# tensor-core path and the CUDA-core path against the CPU), then `bench decode` with a real
# prefill of the Llama-3.1-8B shape (random bf16 weights, one rank, kernels compiled first) at
# CONTEXTS, then model-check's bf16 cases (tiny fixtures and an 8B-shaped model against
# transformers) for the whole model with the new path.
#
# Run from the repository root on the device machine with the release binaries in $DIR/canopy
# and $DIR/layer_ops (DIR defaults to .device). CONTEXTS (default 8K,32K), CHUNKS (the
# --prefill-chunk values each context runs with, default 8K), DECODE (3) and CHECK (1: run
# model-check) narrow the run; AB_SOURCES, a folder of kernel sources
# (CANOPY_KERNEL_SOURCES), times each context again with them for an A/B in the same call.
# PROFILE, a context, adds Nsight Compute's per-kernel durations (clocks as run) of the first
# LAUNCHES kernels of `generate` at it (the prefill's), summed per kernel name in the log. Sections
# stop being started once the script has run DEADLINE seconds (default 540). Results under
# $OUT: log.txt, prefill-*.json, kernels-*.csv, model-check*.
set -uo pipefail
DIR=${DIR:-.device}
CANOPY_BIN=$DIR/canopy
source "$(dirname "$0")/env.sh"
DEADLINE=${DEADLINE:-540}
{
  log "machine"; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
  log "compile-kernels (so that no timing below includes NVRTC)"
  $BIN compile-kernels 2>&1 | tail -1
  log "layer-op tests: attention"
  "$DIR/layer_ops" --test-threads 1 --nocapture attention 2>&1 | grep -E "test |result|FAIL|panick|error|heads|vs cpu"
  log "layer-op tests: the rest"
  "$DIR/layer_ops" --test-threads 1 --skip attention 2>&1 | grep -E "test |result|FAIL|panick"
  prefill() { # context chunk label [env...]
    local context=$1 chunk=$2 label=$3; shift 3
    [ "$(left)" -lt 60 ] && { log "SKIPPED prefill $context $label (time)"; return; }
    log "bench decode llama-3.1-8b, prefill $context in chunks of $chunk ($label)"
    env "$@" $BIN bench decode --arch llama-3.1-8b --random-weights --context "$context" --ranks 1 \
      --strategy tree --decode "${DECODE:-3}" --prefill-chunk "$chunk" --json \
      > "$OUT/prefill-$context-$chunk-$label.json" || { echo "FAILED"; return; }
    python3 -c 'import json,sys
r=json.load(open(sys.argv[1]))
for x in r["rows"]: print(f"  {x["context"]:>7}: prefill {x["fill_s"]:.3f} s, {x["prefill_tokens_per_s"]:.0f} tokens/s, {x["prefill_tflops_per_device"]:.1f} TFLOP/s (GEMM rate {r["gemm_tflops"]:.0f}); decode {x["decode_ms_per_token"]:.2f} ms/token; peak {(x["peak_bytes"] or 0)/2**30:.1f} GiB")' "$OUT/prefill-$context-$chunk-$label.json"
  }
  for context in $(echo "${CONTEXTS:-8K,32K}" | tr , ' '); do
    for chunk in $(echo "${CHUNKS:-8K}" | tr , ' '); do
      prefill "$context" "$chunk" built-in
      if [ -n "${AB_SOURCES:-}" ]; then
        CANOPY_KERNEL_SOURCES=$AB_SOURCES CANOPY_KERNEL_CACHE=/tmp/canopy-kernels-ab $BIN compile-kernels > /dev/null 2>&1
        prefill "$context" "$chunk" "$(basename "$AB_SOURCES")" CANOPY_KERNEL_SOURCES="$AB_SOURCES" CANOPY_KERNEL_CACHE=/tmp/canopy-kernels-ab
      fi
    done
  done
  if [ -n "${PROFILE:-}" ] && [ "$(left)" -gt 120 ]; then
    log "ncu, prefill $PROFILE, first ${LAUNCHES:-450} kernels"
    ncu --clock-control none --metrics gpu__time_duration.sum --csv --launch-count "${LAUNCHES:-450}" \
      $BIN generate --arch llama-3.1-8b --random-weights --backend cuda --context "$PROFILE" \
      --context-fill prefill --max-tokens 1 > "$OUT/kernels-$PROFILE.csv" 2> "$OUT/ncu-err.txt"
    python3 -c 'import csv,sys,collections
rows=[r for r in csv.reader(open(sys.argv[1])) if len(r)>10]
head=rows[0]; k=head.index("Kernel Name"); v=head.index("Metric Value"); u=head.index("Metric Unit")
tot=collections.defaultdict(float); n=collections.Counter()
for r in rows[1:]:
    x=float(r[v].replace(",","")); x*= {"nsecond":1e-6,"usecond":1e-3,"msecond":1.0}.get(r[u],1.0)
    name=r[k].split("(")[0][:60]; tot[name]+=x; n[name]+=1
for name,ms in sorted(tot.items(), key=lambda t:-t[1]): print(f"  {ms:9.2f} ms  {n[name]:4d}x  {name}")
print(f"  {sum(tot.values()):9.2f} ms  total")' "$OUT/kernels-$PROFILE.csv" || tail -5 "$OUT/ncu-err.txt"
  fi
  if [ "${CHECK:-1}" = 1 ] && [ "$(left)" -gt 150 ]; then
    log "model-check, bf16"
    STAGES="fixtures device" FIXTURE_CASES="bf16:1:tree bf16:3:ring f32:1:tree" TINY_CASES="bf16:1:tree" \
      BIG_CASES="bf16:1:tree bf16:2:ring" DEADLINE=$(($(left) - 10)) \
      bash "$(dirname "$0")/model-check.sh" > "$OUT/model-check-log.txt" 2>&1
    tail -3 "$OUT/model-check-log.txt"
  fi
} 2>&1 | tee "$OUT/log.txt"
