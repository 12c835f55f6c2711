#!/usr/bin/env bash
# The tail walks, build against build: the logit-op tests (each walk against the CPU's), then
# sampling-timeline.sh for each binary of BINS (name=path; default the carried one) with N
# samples for each of NS (64: a batch whose every row walks on random weights; 1: a step that
# walks one row, as a trained model's batch mostly does). Results: $OUT/logit-ops.txt and $OUT/NAME-nN/sampling-steps.txt.
set -uo pipefail
source "$(dirname "$0")/env.sh"
here=$(dirname "$0")
log "logit-op tests"
.device/logit_ops --test-threads 1 2>&1 | grep -E "^test |test result|panicked|walk_tails|  " \
  | tee "$OUT/logit-ops.txt"
export SAMPLINGS=${SAMPLINGS:-t1=--temperature_1 top-p=--temperature_1_--top-p_0.9}
for entry in ${BINS:-new=$BIN}; do
  name=${entry%%=*} path=${entry#*=}
  for n in ${NS:-64 1}; do
    log "$name, n = $n"
    OUT=$OUT/$name-n$n CANOPY_BIN=$path N=$n bash "$here/sampling-timeline.sh" | grep -E "^==|decode_median|walk_|top_logits|FAILED"
  done
done
