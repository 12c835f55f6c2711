#!/usr/bin/env bash
# Correctness of canopy's CUDA model runtime (`canopy generate --backend cuda`) against Hugging
# Face transformers' fp32 outputs, all on one GPU (P ranks run as threads on it):
#   fixtures     the committed tiny models (tests/fixtures/tiny/*), every reference prompt, in
#                FIXTURE_CASES (f32 on 1-3 ranks, bf16 on 1 and 3; tree and ring), 32 tokens;
#   tiny-device  a tiny random Llama made here by transformers (f32 weights), TINY_CASES;
#   llama8b      a Llama-3.1-8B-shaped model of NUM_LAYERS layers (bf16 weights) on 1, 2 and 4
#                ranks, BIG_CASES.
# `model_check.py reference` makes the two device models and their fp32 references (GPU, TF32
# off) while the fixture cases run, and exits before any device-model case starts. `model_check.py
# compare` then checks first logits, decode-step logits, greedy tokens, and P ranks against one
# rank (tolerances in its docstring). Results under $OUT: model-check.json and .txt, this output
# (model-check-log.txt), every canopy call's stderr (canopy-stderr.log), reference.log, and the raw
# outputs with the references (model-check-runs.tgz). The last line is ALL PASS or FAILURES: n,
# with how many failed, errored or were not run for time (all three count); the exit status is
# 0 only for ALL PASS.
# Knobs: STAGES ("fixtures device"), VARIANTS, FIXTURE_CASES, TINY_CASES, BIG_CASES (each a list
# of DTYPE:RANKS:STRATEGY), NUM_LAYERS, SEED, JOBS (tiny cases at once), DEADLINE (no canopy call
# runs past it), the *_LIMIT caps, WORK (scratch, wiped at the start: models, references, raw
# outputs).
set -uo pipefail
source "$(dirname "$0")/env.sh"
PY="python3 $(cd "$(dirname "$0")" && pwd)/model_check.py"
export PYTHONUNBUFFERED=1
WORK=${WORK:-/tmp/canopy-model-check}
RUNS=$WORK/runs
STAGES=${STAGES:-fixtures device}
VARIANTS=${VARIANTS:-gqa-hd64 llama3-hd128 tied-mha-hd64}
FIXTURE_CASES=${FIXTURE_CASES:-f32:1:tree f32:1:ring f32:2:tree f32:2:ring f32:3:tree f32:3:ring bf16:1:tree bf16:1:ring bf16:3:tree bf16:3:ring}
TINY_CASES=${TINY_CASES:-f32:1:tree f32:2:ring bf16:1:tree bf16:2:tree}
BIG_CASES=${BIG_CASES:-f32:1:tree bf16:1:tree bf16:2:tree bf16:2:ring bf16:4:tree bf16:4:ring}
NUM_LAYERS=${NUM_LAYERS:-4}
SEED=${SEED:-1234}
JOBS=${JOBS:-4}
DEADLINE=${DEADLINE:-450}
REF_LIMIT=${REF_LIMIT:-240}
FIXTURE_LIMIT=${FIXTURE_LIMIT:-200}
TINY_LIMIT=${TINY_LIMIT:-60}
BIG_LIMIT=${BIG_LIMIT:-200}
CASE_LIMIT=${CASE_LIMIT:-60}
BIG_CASE_LIMIT=${BIG_CASE_LIMIT:-120}
MIN_CASE=10 # seconds: no case is started with less left than this

has_stage() { [[ " $STAGES " == *" $1 "* ]]; }
min() { echo $(($1 < $2 ? $1 : $2)); }
# timing PHASE SECONDS NOTE: printed now, and kept for compare's summary.
timing() {
  printf '%s\t%s\t%s\n' "$1" "$2" "$3" >> "$WORK/timings.tsv"
  log "$1 done in $2 s $3"
}

# run_case NAME MODEL_DIR DTYPE RANKS STRATEGY MAX_TOKENS PROMPT_IDS LIMIT: one canopy call, its
# stdout (the JSON) and stderr in $RUNS, its exit status and seconds in NAME.rc.
run_case() {
  local start=$SECONDS rc
  timeout -k 10 "$8" "$BIN" generate --model "$2" --prompt-ids "$7" --max-tokens "$6" \
    --backend cuda --dtype "$3" --ranks "$4" --strategy "$5" --temperature 0 --json --logits \
    < /dev/null > "$RUNS/$1.json" 2> "$RUNS/$1.log"
  rc=$?
  echo "$rc $((SECONDS - start))" > "$RUNS/$1.rc"
  [ "$rc" -eq 0 ] || echo "   $1: exit $rc after $((SECONDS - start)) s"
}

# run_group GROUP JOBS PHASE_LIMIT CASE_LIMIT: the cases of plan-GROUP.tsv, JOBS at a time, the
# first alone (it compiles the kernels into the cache the others then read). A subshell, so that
# its job count sees its own cases only. No case starts once the phase has run PHASE_LIMIT
# seconds or with DEADLINE near; compare reports those as skipped.
run_group() (
  start=$SECONDS n=0 skipped=0
  while IFS=$'\t' read -r name _ dir _ _ dtype ranks strategy max ids; do
    while [ "$(jobs -rp | wc -l)" -ge "$2" ]; do wait -n; done
    limit=$(min "$(min $(($3 - (SECONDS - start))) $((DEADLINE - SECONDS)))" "$4")
    if [ "$limit" -lt "$MIN_CASE" ]; then
      skipped=$((skipped + 1))
      continue
    fi
    run_case "$name" "$dir" "$dtype" "$ranks" "$strategy" "$max" "$ids" "$limit" &
    n=$((n + 1))
    [ "$n" -eq 1 ] && wait
  done < "$WORK/plan-$1.tsv"
  wait
  [ "$skipped" -eq 0 ] || echo "   $1: $skipped case(s) skipped, the phase's time ran out"
  timing "$1" $((SECONDS - start)) "($n case(s) run, $skipped skipped)"
)

# plan GROUP CASES [ARGS...]: the group's cases into plan-GROUP.tsv (none for a device group
# before its reference exists), or the check stops: a bad knob must not pass as "no cases".
plan() {
  $PY plan "$1" --work "$WORK" --configs "$2" "${@:3}" > "$WORK/plan-$1.tsv" \
    || { echo "FAILURES: 1 (model_check.py plan $1 failed)"; exit 2; }
}

# The device models and their fp32 references (torch on the GPU); the process ends before
# the device-model cases start, so its GPU memory is free for them.
reference() {
  local start=$SECONDS rc
  timeout -k 10 "$(min "$REF_LIMIT" $((DEADLINE - SECONDS)))" $PY reference --work "$WORK" \
    --seed "$SEED" --num-layers "$NUM_LAYERS" > "$OUT/reference.log" 2>&1
  rc=$?
  timing reference $((SECONDS - start)) "(exit $rc, reference.log)"
}

# Every canopy call's stderr in one file, in plan order, each cut to its last 200 lines (the
# whole of each is in the archive); the raw outputs and references in one archive (the device
# returns few files).
collect() {
  local g name
  for g in fixtures tiny-device llama8b; do
    [ -f "$WORK/plan-$g.tsv" ] || continue
    cut -f1 "$WORK/plan-$g.tsv" | while read -r name; do
      [ -f "$RUNS/$name.rc" ] || continue
      echo "=== $name (exit, seconds: $(cat "$RUNS/$name.rc"))"
      tail -n 200 "$RUNS/$name.log"
    done
  done > "$OUT/canopy-stderr.log"
  (cd "$WORK" && tar czf "$OUT_ABS/model-check-runs.tgz" runs plan-*.tsv $(ls ./*.ref.json 2> /dev/null))
}

{
  OUT_ABS=$(cd "$OUT" && pwd)
  log "machine: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader)"
  if [ ! -x "$BIN" ]; then
    echo "no canopy binary at $BIN (CANOPY_BIN)"
    echo "FAILURES: 1"
    exit 2
  fi
  help=$("$BIN" generate --help 2>&1)
  for flag in --prompt-ids --max-tokens --backend --dtype --ranks --strategy --temperature \
    --json --logits; do
    grep -q -- "$flag" <<< "$help" || echo "warning: canopy generate --help does not mention $flag"
  done
  rm -rf "$WORK" "$OUT/model-check.txt" "$OUT/model-check.json"
  mkdir -p "$RUNS"
  $PY selftest || { echo "FAILURES: 1 (model_check.py selftest)"; exit 2; }
  has_stage fixtures && plan fixtures "$FIXTURE_CASES" --variants "$VARIANTS"
  if has_stage device; then
    plan tiny-device "$TINY_CASES"
    plan llama8b "$BIG_CASES"
  fi
  expect=""
  if has_stage device; then
    log "reference: device models (NUM_LAYERS=$NUM_LAYERS for the 8B shape), seed $SEED"
    reference &
    ref_pid=$!
    expect=tiny-device,llama8b
  fi
  if has_stage fixtures; then
    log "fixtures: $VARIANTS; cases $FIXTURE_CASES; $JOBS at a time"
    run_group fixtures "$JOBS" "$FIXTURE_LIMIT" "$CASE_LIMIT"
  fi
  if has_stage device; then
    wait "$ref_pid"
    log "GPU memory in use after the reference:" \
      "$(nvidia-smi --query-gpu=memory.used --format=csv,noheader)"
    log "tiny-device: cases $TINY_CASES"
    plan tiny-device "$TINY_CASES"
    run_group tiny-device "$JOBS" "$TINY_LIMIT" "$CASE_LIMIT"
    log "llama8b (NUM_LAYERS=$NUM_LAYERS): cases $BIG_CASES, one at a time"
    plan llama8b "$BIG_CASES"
    run_group llama8b 1 "$BIG_LIMIT" "$BIG_CASE_LIMIT"
  fi
  collect
  log "compare"
  $PY compare --work "$WORK" --out "$OUT" --expect "$expect"
  rc=$?
  [ -f "$OUT/model-check.txt" ] || { echo "FAILURES: 1 (model_check.py compare exited $rc)"; rc=2; }
  exit "$rc"
} 2>&1 | tee "$OUT/model-check-log.txt"
exit "${PIPESTATUS[0]}"
