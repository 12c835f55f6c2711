#!/usr/bin/env bash
# MPI checks on a CPU-only machine (run by .ci/run after `cargo build --release -p canopy-cli
# --features mpi`):
#  1. a 4-rank `mpirun` of the CPU backend, every tree collective and the ring, against the
#     f64 oracle;
#  2. ranks started with different configurations fail with a clear message;
#  3. killing one rank of a running job ends every rank, non-zero, within the timeout;
#  4. without --launcher, the binary sees mpirun and runs as its ranks: one document.
#  5. the model runtime under mpirun: a tiny Llama on 3 processes and on 8, tree and ring,
#     decodes the tokens one process decodes; so does a longer prompt prefilled in pieces on
#     3 (its later pieces merge by reduce-scatter).
#  6. `bench decode` under mpirun: one report of the 2-rank runs (every collective asked for
#     and the ring), from rank 0 alone;
#  7. `serve` under mpirun: the tiny model on 3 processes, tree and ring, answers every
#     request field as one process does.
# Rank processes are found among this script's own mpirun's descendants, never by name, so
# other jobs on a shared machine are left alone. Prints "N passed, N failed" last.
set -uo pipefail
cd "$(dirname "$0")/../.."
BIN=${CANOPY_BIN:-target/release/canopy}
# The binary's process name, as ps shows it (at most 15 characters).
COMM=$(basename "$BIN" | cut -c1-15)
ROOT=()
[ "$(id -u)" = 0 ] && ROOT=(--allow-run-as-root)
MPIRUN=(mpirun "${ROOT[@]}" --oversubscribe -np 4)
passed=0; failed=0
ok() { echo "PASS: $*"; passed=$((passed + 1)); }
bad() { echo "FAIL: $*"; failed=$((failed + 1)); }
# Every process below pid $1 (below a job's timeout: its mpirun, and the ranks below that).
descendants() {
  local child
  for child in $(pgrep -P "$1"); do
    echo "$child"
    descendants "$child"
  done
}
# The rank processes (of $BIN) below pid $1.
ranks_of() {
  local pid
  for pid in $(descendants "$1"); do
    if [ "$(ps -o comm= -p "$pid")" = "$COMM" ]; then echo "$pid"; fi
  done
}
# Those of pids $@ that still run $BIN. A rank that has exited but is not reaped yet (a
# zombie, state Z, left to init once mpirun is gone) does not count.
alive() {
  local pid stat comm
  for pid in "$@"; do
    read -r stat comm < <(ps -o stat=,comm= -p "$pid") || continue
    if [ "${stat:0:1}" != Z ] && [ "$comm" = "$COMM" ]; then echo "$pid"; fi
  done
}

# 1. Four ranks, every strategy (hierarchical over 2 virtual nodes of 2), exact against the
#    oracle.
if out=$(timeout 120 "${MPIRUN[@]}" "$BIN" bench attention --launcher mpi --backend cpu --seq-len 8192 --iters 2 --virtual-nodes 2 --json) &&
   python3 -c "
import json, sys
d = json.loads(sys.argv[1])
rows = d['rows']
assert len(rows) == 6, rows
for r in rows:
    assert r['ranks'] == 4 and r['rel_error'] < 1e-5, r
print('4 ranks:', ', '.join(f\"{r['strategy']} {r['rel_error']:.1e}\" for r in rows))
" "$out"; then ok "4-rank mpirun matches the oracle"; else bad "4-rank mpirun"; fi

# 2. A rank with different arguments is refused.
err=$(timeout 60 mpirun "${ROOT[@]}" --oversubscribe -np 2 "$BIN" bench attention --launcher mpi --backend cpu --seq-len 4096 --iters 1 : \
      -np 2 "$BIN" bench attention --launcher mpi --backend cpu --seq-len 2048 --iters 1 2>&1)
rc=$?
if [ $rc -ne 0 ] && grep -q "different configuration" <<<"$err"; then ok "mismatched configurations are refused"; else bad "mismatch (rc=$rc): $err"; fi

# 3. Kill one rank mid-run: the whole job ends, non-zero, well within the timeout.
start=$(date +%s)
timeout 120 "${MPIRUN[@]}" "$BIN" bench attention --launcher mpi --backend cpu --seq-len 65536 --iters 1000 --strategy ring >/dev/null 2>&1 &
job=$!
ranks=()
for _ in $(seq 1 100); do
  mapfile -t ranks < <(ranks_of "$job")
  [ ${#ranks[@]} -ge 4 ] && break
  sleep 0.1
done
victim=${ranks[2]:-}
sleep 2
[ -n "$victim" ] && kill -9 "$victim"
wait $job
rc=$?
elapsed=$(( $(date +%s) - start ))
# Ranks that outlived mpirun are no longer below it: look them up by the pids seen above.
# Open MPI signals the rest of the job as mpirun ends; give them a few seconds to exit.
for _ in $(seq 1 50); do
  mapfile -t left < <(alive "${ranks[@]}")
  [ ${#left[@]} = 0 ] && break
  sleep 0.2
done
elapsed=$(( $(date +%s) - start ))
[ ${#left[@]} -gt 0 ] && kill -9 "${left[@]}"
if [ -n "$victim" ] && [ $rc -ne 0 ] && [ $rc -ne 124 ] && [ ${#left[@]} = 0 ] && [ $elapsed -lt 60 ]; then
  ok "killing rank process $victim ended the job (exit $rc) in ${elapsed}s"
else
  bad "kill test: victim='$victim' of ranks '${ranks[*]}' rc=$rc elapsed=${elapsed}s ranks left='${left[*]}'"
fi

# 4. No --launcher: the MPI build sees mpirun, runs as its two ranks and prints one document.
if out=$(timeout 60 mpirun "${ROOT[@]}" --oversubscribe -np 2 "$BIN" bench attention --backend cpu --seq-len 4096 --iters 1 --json) &&
   python3 -c "
import json, sys
text = sys.argv[1]
d, end = json.JSONDecoder().raw_decode(text.lstrip())
assert text.lstrip()[end:].strip() == '', 'more than one document: ' + text
assert d['rows'] and all(r['ranks'] == 2 for r in d['rows']), d['rows']
print('detected mpirun:', len(d['rows']), 'rows on 2 ranks, one document')
" "$out"; then ok "mpirun without --launcher runs one 2-rank job"; else bad "mpirun without --launcher: $out"; fi

# 5. The model runtime under mpirun: a tiny Llama sharded over 3 processes and over 8 (a
#    DGX node's rank count, some ranks holding few or none of the prompt's tokens), tree and
#    ring, gives the tokens one process gives.
MODEL=tests/fixtures/tiny/llama3-hd128
gen() { "$@" generate --model "$MODEL" --prompt "the quick brown fox jumps" --max-tokens 16 --strategy "$strategy" --json; }
strategy=tree
one=$(gen timeout 120 "$BIN")
for np in 3 8; do
  if tree=$(gen timeout 120 mpirun "${ROOT[@]}" --oversubscribe -np $np "$BIN") &&
     ring=$(strategy=ring gen timeout 120 mpirun "${ROOT[@]}" --oversubscribe -np $np "$BIN") &&
     python3 -c "
import json, sys
docs = [json.loads(a) for a in sys.argv[2:]]
toks = [d['samples'][0]['tokens'] for d in docs]
assert len(toks[0]) == 16 and toks[1] == toks[0] and toks[2] == toks[0], toks
assert docs[1]['ranks'] == int(sys.argv[1]) and docs[2]['strategy'] == 'ring', docs
" $np "$one" "$tree" "$ring"; then ok "generate on $np MPI ranks (tree and ring) equals one process"; else bad "generate under mpirun -np $np"; fi
done
# 148 tokens in pieces of 48 (a page of 16 a rank): four pieces over 3 processes, the first
# token's logits within 1e-4 of one process's and the same tokens.
long_prompt=$(printf 'the quick brown fox jumps over the lazy dog %.0s' $(seq 1 5))
pieces() { "$@" generate --model "$MODEL" --prompt "$long_prompt" --max-tokens 8 --prefill-chunk 16 --logits --json; }
one=$(pieces timeout 120 "$BIN")
if split=$(pieces timeout 120 mpirun "${ROOT[@]}" --oversubscribe -np 3 "$BIN") &&
   python3 -c "
import json, sys
one, split = (json.loads(a) for a in sys.argv[1:])
assert one['prompt_tokens'] > 144, one['prompt_tokens']
toks = [d['samples'][0]['tokens'] for d in (one, split)]
assert split['ranks'] == 3 and toks[1] == toks[0], toks
a, b = one['logits']['first'], split['logits']['first']
assert len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < 1e-4, 'first logits differ'
" "$one" "$split"; then ok "a prompt in four pieces on 3 MPI ranks equals one process"; else bad "a prompt in pieces under mpirun -np 3"; fi

# 6. bench decode on 2 MPI ranks: rank 0 alone prints one JSON document, with a row per
#    context and strategy, each timed.
if out=$(timeout 120 mpirun "${ROOT[@]}" --oversubscribe -np 2 "$BIN" bench decode --model "$MODEL" --backend cpu \
           --context 64,128 --decode 4 --ranks 1,2 --strategy tree,ring --collective auto,allgather --json) &&
   python3 -c "
import json, sys
text = sys.argv[1].lstrip()
d, end = json.JSONDecoder().raw_decode(text)
assert text[end:].strip() == '', 'more than one document: ' + text
rows = d['rows']
got = sorted((r['context'], r['strategy']) for r in rows)
want = sorted((c, s) for c in (64, 128) for s in ('tree/auto', 'tree/allgather', 'ring'))
assert got == want, got
assert all(r['ranks'] == 2 and r['decode_ms_per_token'] > 0 and r['peak_bytes'] > 0 for r in rows), rows
print('bench decode on 2 MPI ranks:', len(rows), 'rows')
" "$out"; then ok "bench decode under mpirun reports the 2-rank runs once"; else bad "bench decode under mpirun: $out"; fi

# 7. The server under mpirun: the tiny fixture model on 3 processes, tree and ring, answers
#    every request field as one process does (serve_fields.py check: texts equal,
#    log-probabilities within 2e-3), its prompts' prefill passes split over the processes;
#    SIGTERM to mpirun drains the job, which ends within a minute.
TINY=tests/fixtures/tiny/gqa-hd64
PROMPTS=$(mktemp)
python3 -c "import json; print(json.dumps([p['token_ids'] for p in json.load(open('$TINY/reference.json'))['prompts']]))" > "$PROMPTS"
# serve_on LOG STRATEGY LAUNCH...: `canopy serve` of the tiny model on a free port, started by
# LAUNCH (the binary, or an mpirun of it); sets SERVER (its pid) and URL, or fails once the
# server is gone or 60 s have passed.
serve_on() {
  local log=$1 strategy=$2 waited=0
  shift 2
  "$@" serve --model "$TINY" --backend cpu --strategy "$strategy" --port 0 > "$log" 2>&1 &
  SERVER=$! URL=
  while [ -z "$URL" ] && [ $waited -lt 120 ] && kill -0 $SERVER 2>/dev/null; do
    sleep 0.5
    waited=$((waited + 1))
    URL=$(grep -o 'listening on http://[0-9.:]*' "$log" | head -1 | cut -d' ' -f3)
  done
  [ -n "$URL" ]
}
# ends_within SECONDS PID: whether PID (a child of this shell) ends within SECONDS.
ends_within() {
  local waited=0
  while kill -0 "$2" 2>/dev/null; do
    [ $waited -ge $(($1 * 2)) ] && return 1
    sleep 0.5
    waited=$((waited + 1))
  done
  wait "$2" 2>/dev/null
  return 0
}
one_log=$(mktemp)
mpi_log=$(mktemp)
serve_on "$one_log" tree "$BIN"
one_pid=$SERVER one_url=$URL
for strategy in tree ring; do
  if [ -n "$one_url" ] &&
     serve_on "$mpi_log" $strategy timeout 300 mpirun "${ROOT[@]}" --oversubscribe -np 3 "$BIN" &&
     check=$(timeout 120 python3 launch/device/serve_fields.py check "$URL" "$one_url" "$PROMPTS") &&
     [ "$(echo "$check" | tail -1)" = "ALL PASS" ] &&
     kill -TERM "$SERVER" && ends_within 60 "$SERVER"; then
    ok "serve on 3 MPI ranks ($strategy) answers as one process"
  else
    bad "serve under mpirun -np 3 ($strategy): ${check:-no check}; $(tail -3 "$mpi_log")"
    kill -TERM "$SERVER" 2>/dev/null
    wait "$SERVER" 2>/dev/null
  fi
  check=
done
kill -TERM "$one_pid" 2>/dev/null
wait "$one_pid" 2>/dev/null
rm -f "$PROMPTS" "$one_log" "$mpi_log"

echo "$passed passed, $failed failed"
[ $failed -eq 0 ]
