# Environment for canopy's device scripts (sourced): results directory, NVRTC on the library
# path, NVLink multicast off, kernel cache outside $OUT, and the carried binary.
OUT=${OUT:-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export CANOPY_KERNEL_CACHE=/tmp/canopy-kernels
BIN=${CANOPY_BIN:-.device/canopy}
# Binaries travel gzipped (the carried tree is limited in size): unpacked once, beside them.
for packed in .device/*.gz; do
  [ -f "$packed" ] && [ ! -f "${packed%.gz}" ] && gunzip -k "$packed" && chmod +x "${packed%.gz}"
done
# A section's heading with the script's seconds so far, and the seconds left before the
# script's DEADLINE (each script sets its own).
log() { echo "== [${SECONDS}s] $*"; }
left() { echo $((DEADLINE - SECONDS)); }
# Plot labels need a TrueType font: matplotlib's DejaVu Sans where the machine has no other.
export CANOPY_FONT=${CANOPY_FONT:-$(python3 -c 'import matplotlib, os
print(os.path.join(os.path.dirname(matplotlib.__file__), "mpl-data/fonts/ttf/DejaVuSans.ttf"))' 2>/dev/null)}
# start_server NAME ARGS...: `canopy serve` on a free port, its log in
# $SERVER_LOGS/server-NAME.log ($OUT by default); sets SERVER (its pid) and URL.
start_server() {
  local name=$1 logs=${SERVER_LOGS:-$OUT}
  shift
  $BIN serve --port 0 "$@" > "$logs/server-$name.log" 2>&1 &
  SERVER=$!
  URL=
  while [ -z "$URL" ]; do
    kill -0 $SERVER 2>/dev/null || { log "server $name died:"; tail -5 "$logs/server-$name.log"; return 1; }
    sleep 0.5
    URL=$(grep -o 'listening on http://[0-9.:]*' "$logs/server-$name.log" | head -1 | cut -d' ' -f3)
  done
  log "server $name at $URL"
}
# stop_server [PID]: drains the server (default $SERVER) and waits for it.
stop_server() { kill -TERM "${1:-$SERVER}" 2>/dev/null; wait "${1:-$SERVER}" 2>/dev/null; }
# load_each_bin PY: for each binary of BINS (name=path; default $BIN alone), the 8B shape with
# random weights served on the GPU (on RANKS ranks, default 1) and `python3 PY load` run
# against it until DEADLINE; its
# JSON lines, tagged with the binary's name, into $OUT/load.jsonl, and the server's decode
# passes into $OUT/decode-passes-NAME.txt.
load_each_bin() {
  local entry name
  for entry in ${BINS:-new=$BIN}; do
    name=${entry%%=*} BIN=${entry#*=}
    start_server "gpu-8b-$name" --arch llama-3.1-8b --random-weights --backend cuda \
      --max-batch 64 --max-context 4096 --kv-tokens 131072 --ranks "${RANKS:-1}" || continue
    log "load, $name"
    timeout $(( DEADLINE - SECONDS )) python3 "$1" load "$URL" | sed "s/^{/{\"bin\": \"$name\", /" \
      | tee -a "$OUT/load.jsonl"
    curl -s "$URL/metrics" | grep -E "^canopy_decode_" > "$OUT/decode-passes-$name.txt"
    stop_server "$SERVER"
  done
}
# A FastTree-shaped workload at 32/8 heads x 128, fp16, as /tmp/NAME.toml (for ncu runs on
# trees of one part: a root alone, leaves alone): tree_toml NAME NODES_PER_LEVEL TOKENS_PER_LEVEL.
tree_toml() {
  cat > "/tmp/$1.toml" <<T
description = "$1"
[shape]
q_heads = 32
kv_heads = 8
head_dim = 128
dtype = "f16"
[tree]
kind = "fasttree"
nodes_per_level = [$2]
tokens_per_level = [$3]
T
}
# The carried test binaries: the layer-op and attention-block tests (the CUDA LayerOps against
# the CPU), then the replay-equals-eager graph test and what moves the graph epoch, the staged
# weight upload, the ops on logits, the products' tuning and the transport of ranks on one
# GPU, one line per test and a result line each, into $OUT/tests.txt. Each binary's whole
# output goes to $OUT/tests/NAME.txt; a failing test's message and the seeds of its random
# inputs (CANOPY_TEST_SEED, which replays them) are shown with it.
device_test() {
  local name=$1 shown=$2
  shift 2
  [ -x ".device/$name" ] || { echo "$name: not carried"; return 0; }
  mkdir -p "$OUT/tests"
  ".device/$name" "$@" > "$OUT/tests/$name.txt" 2>&1
  grep -E "^test |test result|panicked${shown:+|$shown}" "$OUT/tests/$name.txt"
  grep -q "test result: FAILED" "$OUT/tests/$name.txt" \
    && grep -E "CANOPY_TEST_SEED|panicked at" -A1 "$OUT/tests/$name.txt" | grep -v "^test "
  return 0
}
device_tests() {
  {
    log "layer-op tests"
    device_test layer_ops "bit for bit: false" --test-threads 1
    log "attention-block tests"
    device_test attention_blocks "max error" --test-threads 1
    log "graph tests"
    device_test cuda_graphs ""
    device_test graph_epoch ""
    log "weight-upload test"
    device_test weight_upload ""
    log "logit-op tests"
    device_test logit_ops "" --test-threads 1
    log "product-tuning tests"
    device_test product_tuning "shapes chosen" --test-threads 1 --nocapture
    log "transport tests (ranks as threads on the GPU)"
    device_test device_world "" --test-threads 1
  } 2>&1 | tee "$OUT/tests.txt"
}
# Builds tools/cupti_trace.c against the machine's CUPTI (the header's newest record types) and
# prints the library's path, or nothing where there is no CUPTI; what it found goes to stderr.
# A process run with CUDA_INJECTION64_PATH set to it writes its trace to $CUPTI_TRACE_OUT.
build_tracer() {
  local header lib newest types
  header=$(find /usr/local /usr/include /opt -name cupti_activity.h 2>/dev/null | head -1)
  lib=$(find /usr/local /usr/lib /opt -name "libcupti.so*" 2>/dev/null | head -1)
  echo "CUPTI: header ${header:-none}, library ${lib:-none}" >&2
  [ -n "$header" ] && [ -n "$lib" ] || return 0
  newest() { grep -o "} $1[0-9]*;" "$header" | tr -d '}; ' | sort -V | tail -1; }
  types="-DKERNEL_T=$(newest CUpti_ActivityKernel) -DMEMCPY_T=$(newest CUpti_ActivityMemcpy) -DMEMSET_T=$(newest CUpti_ActivityMemset)"
  gcc -O2 -shared -fPIC $types -I"$(dirname "$header")" -I/usr/local/cuda-13.0/include \
    -o /tmp/cupti_trace.so "$(dirname "${BASH_SOURCE[0]}")/tools/cupti_trace.c" "$lib" \
    -Wl,-rpath,"$(dirname "$lib")" >&2 && echo /tmp/cupti_trace.so
}
# A traced script's start: the GPU's name and driver, then the tracer built into $tracer; a
# machine without CUPTI ends the script.
start_traced() {
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  tracer=$(build_tracer)
  [ -n "$tracer" ] || { echo "no CUPTI tracer"; exit 1; }
}
# switch_ab VAR: the set-up of a script that runs canopy with its switch VAR on and off: G (the
# machine's GPUs unless set), RUNS ($OUT/runs, archived into $OUT/runs.tgz at exit), MPIRUN
# (mpirun on G ranks, passing VAR on) and `switched NAME SWITCH COMMAND...`, switched_run's
# call with VAR and RUNS.
switch_ab() {
  AB_SWITCH=$1
  G=${G:-$(nvidia-smi --list-gpus | wc -l)}
  RUNS=$OUT/runs
  mkdir -p "$RUNS"
  trap 'tar czf "$OUT/runs.tgz" -C "$OUT" runs && rm -rf "$RUNS"' EXIT
  MPIRUN=(mpirun --allow-run-as-root -np "$G" -x NCCL_NVLS_ENABLE -x LD_LIBRARY_PATH -x CANOPY_KERNEL_CACHE -x "$AB_SWITCH")
}
switched() { switched_run "$AB_SWITCH" "$RUNS" "$@"; }
# switched_run VAR DIR NAME SWITCH COMMAND...: COMMAND with VAR=SWITCH (an on/off switch of
# canopy's), its JSON report in DIR/NAME-SWITCH.json, summarised one line a row (decode rows
# by ms/token and the floor, scaling rows by median ms and error); skipped with under 45 s of
# the caller's DEADLINE left.
switched_run() {
  local var=$1 dir=$2 name=$3 sw=$4
  shift 4
  [ "$(left)" -lt 45 ] && { log "SKIPPED $name $sw (time)"; return; }
  env "$var=$sw" timeout $(($(left) - 20)) "$@" --json > "$dir/$name-$sw.json" 2>> "$dir/err.txt" \
    || log "FAILED or cut off: $name $sw"
  python3 - "$dir/$name-$sw.json" "$name" "$sw" <<'PY'
import json, sys
path, name, sw = sys.argv[1:]
try:
    r = json.load(open(path))
except ValueError:
    sys.exit(f"{name} {sw}: no report")
for x in r["rows"]:
    if "decode_ms_per_token" in x:
        m = x.get("merge_ms_per_layer")
        print(f"{name} {sw:<3} {x['context']:>7} P={x['ranks']} {x['strategy']:<18} "
              f"{x['decode_ms_per_token']:7.3f} ms/token  x{x['vs_floor']:.3f} floor  "
              f"merge {'-' if m is None else f'{m * 1e3:.1f} us/layer'}")
    else:
        e, g = x.get("rel_error"), x.get("link_gbps")
        print(f"{name} {sw:<3} {x['seq_len']:>8} P={x['ranks']} {x['strategy']:<18} "
              f"{x['median_ms']:8.4f} ms  error {'-' if e is None else f'{e:.1e}'}"
              f"{'' if g is None else f'  link {g:.0f} GB/s'}")
PY
}
# stall_runs DIR ARGS...: `bench attention --backend cuda ARGS --seq-len 131072 --stall-rank 1
# --timeout 5` on the machine's G GPUs, as threads and under "${MPIRUN[@]}" (the caller's):
# rank 1 stops before its first step, and the others must fail within the timeout, naming the
# rank or the watchdog. Each run's output in DIR/stall-{threads,mpi}.txt.
stall_runs() {
  local dir=$1 how t0 rc
  shift
  local stall=(bench attention --backend cuda "$@" --seq-len 131072 --stall-rank 1 --timeout 5)
  for how in threads mpi; do
    log "watchdog, $how, rank 1 stalls, timeout 5 s"
    if [ $how = threads ]; then cmd=($BIN "${stall[@]}" --ranks "$G"); else cmd=("${MPIRUN[@]}" $BIN "${stall[@]}" --launcher mpi); fi
    t0=$(date +%s%N); timeout 60 "${cmd[@]}" > "$dir/stall-$how.txt" 2>&1; rc=$?
    echo "exit $rc after $(( ($(date +%s%N) - t0) / 1000000 )) ms"
    grep -m2 -E "error|watchdog" "$dir/stall-$how.txt"
  done
}
