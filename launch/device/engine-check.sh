#!/usr/bin/env bash
# Issue 21, one distributed engine: `bench attention --backend cuda` (now the engine's rank loop
# over the NCCL transport) against an older binary in the same call, on one GPU (NCCL runs one
# rank per GPU, so p = 1), then the P-ranks-on-one-GPU tests and a selftest.
#
# Run from the repository root on the device machine with the release binary in .device/canopy,
# the older one in .device/canopy-old (its own kernel cache) and the `device_world` test binary
# of canopy-cuda (`cargo test --release -p canopy-cuda --no-run`) in .device/device_world.
# Both binaries run `bench attention --ranks 1` at 32K (checked against the oracle) and at 1M
# (unchecked), 20 steps, every collective and the ring, in the order new, old, old, new; then
# the new one at 1M, checked, tree/allreduce2 and ring; the stall hook; the device_world tests;
# `selftest --ranks 1,2 --cases 0` within DEADLINE seconds (default 400). About 250 s on an
# H100. Results go to $OUT (att*.json; the summary is printed last).
set -uo pipefail
source "$(dirname "$0")/env.sh"
OLD=${CANOPY_OLD_BIN:-.device/canopy-old}
DEVICE_WORLD=${CANOPY_DEVICE_WORLD:-.device/device_world}
DEADLINE=${DEADLINE:-400}
new() { "$BIN" "$@"; }
old() { CANOPY_KERNEL_CACHE=/tmp/canopy-kernels-old "$OLD" "$@"; }
{
  log machine; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  for order in "new old" "old new"; do
    for b in $order; do
      log "attention 32K $b"
      $b bench attention --backend cuda --ranks 1 --seq-len 32768 --iters 20 --json > "$OUT/att32k_$b.$SECONDS.json"
      log "attention 1M $b (no oracle)"
      $b bench attention --backend cuda --ranks 1 --seq-len 1048576 --iters 20 --check-max-tokens 0 --json > "$OUT/att1m_$b.$SECONDS.json"
    done
  done
  log "attention 1M new, checked: tree/allreduce2 and ring"
  new bench attention --backend cuda --ranks 1 --seq-len 1048576 --collective allreduce2 --json > "$OUT/att1m_check_new.json"
  log "stall hook at p=1 (expect a non-zero exit naming the fault)"
  timeout 60 "$BIN" bench attention --backend cuda --ranks 1 --seq-len 4096 --strategy tree --collective allreduce2 --stall-rank 0 --timeout 5; echo "exit $?"
  log "device_world tests"
  timeout 150 "$DEVICE_WORLD" --test-threads 1 2>&1 | grep -E "^test |test result|panicked|p = " ; echo "exit ${PIPESTATUS[0]}"
  l=$((DEADLINE - SECONDS)); log "selftest --ranks 1,2 --cases 0 (cap ${l}s)"
  [ $l -gt 30 ] && { timeout $l "$BIN" selftest --backend cuda --ranks 1,2 --cases 0 2>&1 | tail -8; echo "exit ${PIPESTATUS[0]}"; }
  log summary
  python3 - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
def order(p):
    tag = p.split(".")[-2]
    return int(tag) if tag.isdigit() else 1 << 30
for f in sorted(glob.glob(os.path.join(out, "att*.json")), key=order):
    d = json.load(open(f))
    rows = ", ".join(f"{r['strategy']} {r['median_ms']:.4f} [{r['p10_ms']:.4f}-{r['p90_ms']:.4f}]"
                     + (f" err {r['rel_error']:.2e}" if r.get('rel_error') is not None else "")
                     for r in d["rows"])
    print(os.path.basename(f), "|", rows)
    print("   peak", [r.get("peak_mem_bytes") for r in d["rows"]])
PY
} 2>&1 | tee "$OUT/log.txt"
