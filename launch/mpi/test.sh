#!/usr/bin/env bash
# MPI checks on a CPU-only machine (run by .ci/run after `cargo build --release -p canopy-cli
# --features mpi`):
#  1. a 4-rank `mpirun` of the CPU backend, every tree collective and the ring, against the
#     f64 oracle;
#  2. ranks started with different configurations fail with a clear message;
#  3. killing one rank of a running job ends every rank, non-zero, within the timeout.
# Prints "N passed, N failed" last.
set -uo pipefail
cd "$(dirname "$0")/../.."
BIN=${CANOPY_BIN:-target/release/canopy}
ROOT=()
[ "$(id -u)" = 0 ] && ROOT=(--allow-run-as-root)
MPIRUN=(mpirun "${ROOT[@]}" --oversubscribe -np 4)
passed=0; failed=0
ok() { echo "PASS: $*"; passed=$((passed + 1)); }
bad() { echo "FAIL: $*"; failed=$((failed + 1)); }

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
victim=""
for _ in $(seq 1 100); do
  victim=$(pgrep -f "canopy bench attention --launcher mpi" | grep -v "^$job$" | sed -n 3p)
  [ -n "$victim" ] && break
  sleep 0.1
done
sleep 2
[ -n "$victim" ] && kill -9 "$victim"
wait $job
rc=$?
elapsed=$(( $(date +%s) - start ))
left=$(pgrep -f "canopy bench attention --launcher mpi" | wc -l)
if [ -n "$victim" ] && [ $rc -ne 0 ] && [ $rc -ne 124 ] && [ "$left" = 0 ] && [ $elapsed -lt 60 ]; then
  ok "killing rank process $victim ended the job (exit $rc) in ${elapsed}s"
else
  bad "kill test: victim='$victim' rc=$rc elapsed=${elapsed}s ranks left=$left"
fi

echo "$passed passed, $failed failed"
[ $failed -eq 0 ]
