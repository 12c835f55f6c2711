#!/usr/bin/env bash
# Issue 5 on one H100: tree-structured KV. The CUDA conformance suite with the tensor-core
# kernel forced on, then `bench tree` on FastTree's ten trees at Q_HEADS (default 32) query
# heads over each of HEADS (default 8 and 32) KV heads (fp16, head dim 128) and on DeFT's
# workloads (static and growing), every method. SASS of the tensor-core kernels is checked for
# HMMA. METHODS, HEADS, TREES, GROW=false and STATIC=false narrow the run to fit one device
# call.
#
# Run from the repository root on the device machine with the release binary in .device/.
# STAGE=check runs only the conformance suite; STAGE=bench only the benchmarks. SIMT=true adds
# the CUDA-core kernel's run of every tree beside the default. CACHE=warm times steps with the
# previous step's KV left in L2 (default cold: L2 evicted before each timed step, as the peers'
# do_bench timings were taken).
set -uo pipefail
source "$(dirname "$0")/env.sh"
log() { echo "== $*"; }
STAGE=${STAGE:-all}
ITER=${ITER:-30}
CACHE=${CACHE:-cold}
SUFFIX=$([ "$CACHE" = cold ] || echo "_$CACHE")

{
  log "machine"; nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv
  if [ "$STAGE" != bench ]; then
    log "selftest, tensor-core kernel wherever possible (contiguous and paged KV, 1 rank)"
    time $BIN selftest --backend cuda --ranks 1 --cases ${CASES:-2} --kernel mma
  fi
  if [ "$STAGE" != check ]; then
    for heads in ${HEADS:-8 32}; do
      for t in ${TREES:-0 1 2 3 4 5 6 7 8 9}; do
        q=${Q_HEADS:-32}
        log "fasttree-$t $q/$heads"
        $BIN bench tree --workload fasttree-$t --heads $q --kv-heads $heads --head-dim 128 \
          --dtype f16 --method ${METHODS:-all} --iterations $ITER --cache $CACHE --check ${CHECK:-true} \
          --json > "$OUT/ft${t}_${q}_${heads}${SUFFIX}.json"
        [ "${SIMT:-false}" = true ] && $BIN bench tree --workload fasttree-$t --heads $q \
          --kv-heads $heads --head-dim 128 --dtype f16 --method all --iterations $ITER \
          --check false --kernel simt --json > "$OUT/ft${t}_${q}_${heads}_simt.json"
        grep -o '"method": "[a-z-]*"\|"median_us": [0-9.]*' "$OUT/ft${t}_${q}_${heads}${SUFFIX}.json" | paste -sd' '
      done
    done
    for w in $([ "${GROW:-true}" = true ] && echo few-shot-b50 few-shot-b20); do
      log "$w growing over 400 decode iterations, 32/8"
      $BIN bench tree --workload $w --heads 32 --kv-heads 8 --head-dim 128 --dtype f16 \
        --method q-guided,deft-node,deft-flatten,fasttree,auto --grow 400 --cache $CACHE --json \
        > "$OUT/${w}_grow${SUFFIX}.json"
      $BIN bench tree --workload $w --heads 32 --kv-heads 8 --head-dim 128 --dtype f16 \
        --method q-guided,deft-flatten --grow 20 --check true
    done
    for w in $([ "${STATIC:-true}" = true ] && echo few-shot-b20 few-shot-b50 spec-t64 spec-t256 tot-sorting tot-document); do
      log "$w 32/8"
      $BIN bench tree --workload $w --heads 32 --kv-heads 8 --head-dim 128 --dtype f16 \
        --method ${METHODS:-all} --iterations $ITER --cache $CACHE --json > "$OUT/$w${SUFFIX}.json"
      $BIN bench tree --workload $w --heads 32 --kv-heads 8 --head-dim 128 --dtype f16 \
        --method all --iterations $ITER --check false | tail -n +1
    done
    log "SASS of the tensor-core kernel"
    for f in "$CANOPY_KERNEL_CACHE"/decode_mma-*.cubin; do
      cuobjdump -sass "$f" > /tmp/sass.txt 2>&1 || continue
      printf '%s: HMMA=%s HGMMA=%s LDSM=%s LDGSTS=%s LDL=%s\n' "$(basename "$f")" \
        "$(grep -c 'HMMA' /tmp/sass.txt)" "$(grep -c 'HGMMA' /tmp/sass.txt)" \
        "$(grep -c 'LDSM' /tmp/sass.txt)" "$(grep -c 'LDGSTS' /tmp/sass.txt)" "$(grep -c 'LDL' /tmp/sass.txt)"
    done
  fi
} 2>&1 | tee "$OUT/log${SUFFIX}.txt"
# Many small JSON files: one archive comes back.
(cd "$OUT" && tar czf tree-results${SUFFIX}.tgz ./*.json && rm -f ./*.json)
