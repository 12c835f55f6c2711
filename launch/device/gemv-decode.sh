#!/usr/bin/env bash
# Issue 23, the dense path of a decode step: the layer-op tests (GEMV against the CPU and f64),
# then `bench decode` (random weights and context, one rank, tree) with this binary and a
# baseline binary in the same call, then Nsight Compute's per-kernel durations of this binary's
# decode steps at the GPU's own clocks (`--clock-control none`, as the step runs).
#
# Run from the repository root on the device machine with the release binaries in $DIR/canopy
# (new), $DIR/canopy-base (baseline) and $DIR/layer_ops (the test; DIR defaults to .device).
# ARCHS, CONTEXTS, DECODE and LAUNCHES narrow the run; sections stop being started once the
# script has run DEADLINE seconds (default 500). Results under $OUT: log.txt, decode-*.json,
# kernels.csv.
set -uo pipefail
DIR=${DIR:-.device}
CANOPY_BIN=$DIR/canopy
source "$(dirname "$0")/env.sh"
DEADLINE=${DEADLINE:-500}
base() { CANOPY_KERNEL_CACHE=/tmp/canopy-kernels-base "$DIR/canopy-base" "$@"; }
decode() { # binary arch contexts
  local bin=$1 arch=$2 contexts=$3
  $bin bench decode --arch "$arch" --random-weights --context-fill random --context "$contexts" \
    --ranks 1 --strategy tree --decode "${DECODE:-20}" --json
}
{
  log "machine"; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
  log "layer-op tests"
  "$DIR/layer_ops" --test-threads 1 2>&1 | grep -E "test |result|FAIL|error" | head -20
  for arch in ${ARCHS:-llama-3.1-8b llama-3.2-1b}; do
    for b in new base; do
      [ "$(left)" -lt 90 ] && { log "SKIPPED $arch $b (time)"; continue; }
      log "bench decode $arch ($b)"
      run=$([ $b = new ] && echo "$BIN" || echo base)
      decode "$run" "$arch" "${CONTEXTS:-8K,32K}" > "$OUT/decode-$arch-$b.json" || echo "FAILED $arch $b"
      python3 -c 'import json,sys
r=json.load(open(sys.argv[1]))
for x in r["rows"]: print(f"  {x["context"]:>7} {x["decode_ms_per_token"]:7.2f} ms/token, floor {x["floor_ms"]:.2f}, x{x["vs_floor"]:.2f}")' "$OUT/decode-$arch-$b.json"
    done
  done
  if [ "$(left)" -gt 120 ]; then
    log "ncu (clocks as run), llama-3.1-8b 8K, 3 decode steps"
    ncu --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum --csv \
      --launch-count "${LAUNCHES:-1400}" $BIN bench decode --arch llama-3.1-8b --random-weights \
      --context-fill random --context 8K --ranks 1 --strategy tree --decode 3 > "$OUT/kernels.csv" 2> "$OUT/ncu-err.txt"
    echo "ncu exit $?; $(wc -l < "$OUT/kernels.csv") lines"
  else
    log "SKIPPED ncu (time)"
  fi
} 2>&1 | tee "$OUT/log.txt"
