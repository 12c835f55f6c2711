#!/usr/bin/env bash
# Issue 23, decode attention at short contexts, on one H100: the decode kernel (stage 1 + merge)
# for the Llama-3.1-8B shape (32 q / 8 kv heads x 128) and SmolLM2's (9 q / 3 kv heads x 64) at
# 8K-512K, FastTree's trees 0-9 at 32/8 and 32/32, each with this binary and a baseline binary in
# the same call, then the CUDA selftest.
#
# Run from the repository root on the device machine with the release binaries in
# $DIR/canopy (new) and $DIR/canopy-base (baseline; DIR defaults to .device). Sections stop being
# started once the script has run DEADLINE seconds (default 540). Results: $OUT/log.txt and
# $OUT/results.tgz (kernel_*.json, tree.jsonl, selftest.txt).
set -uo pipefail
DIR=${DIR:-.device}
CANOPY_BIN=$DIR/canopy
source "$(dirname "$0")/env.sh"
BASE=$DIR/canopy-base
DEADLINE=${DEADLINE:-540}
R=$OUT/results; mkdir -p "$R"
trap 'tar czf "$OUT/results.tgz" -C "$OUT" results' EXIT
# The base binary keeps its own kernel cache.
base() { CANOPY_KERNEL_CACHE=/tmp/canopy-kernels-base "$BASE" "$@"; }
jl() {
  python3 -c 'import json,sys
d=json.load(sys.stdin)
d.update(dict(a.split("=",1) for a in sys.argv[1:]))
print(json.dumps(d))' "$@"
}
LLAMA="--heads 32 --kv-heads 8 --head-dim 128 --dtype bf16"
SMOL="--heads 9 --kv-heads 3 --head-dim 64 --dtype bf16"
MHA="--heads 16 --kv-heads 16 --head-dim 128 --dtype bf16"
LENS=8192,32768,131072,524288

{
  log "machine"; nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv
  for shape in LLAMA SMOL MHA; do
    lens=$LENS; [ $shape = MHA ] && lens=32768,131072
    log "decode kernel $shape: new (oracle checked), then base"
    $BIN bench kernel ${!shape} --seq-lens $lens --json-out "$R/kernel_${shape}_new.json"
    base bench kernel ${!shape} --seq-lens $lens --check false --json-out "$R/kernel_${shape}_base.json" > /dev/null
  done
  log "decode kernel LLAMA, batch 4 x 32K"
  $BIN bench kernel $LLAMA --seq-lens 32768 --batch 4 --json-out "$R/kernel_batch4_new.json" > /dev/null
  base bench kernel $LLAMA --seq-lens 32768 --batch 4 --check false --json-out "$R/kernel_batch4_base.json" > /dev/null

  for heads in 8 32; do
    for t in 0 1 2 3 4 5 6 7 8 9; do
      [ "$(left)" -lt 200 ] && { log "SKIPPED fasttree-$t 32/$heads (time)"; continue; }
      for b in new base; do
        run=$([ $b = new ] && echo "$BIN" || echo base)
        $run bench tree --workload fasttree-$t --heads 32 --kv-heads $heads --head-dim 128 \
          --dtype f16 --method fasttree,auto --iterations 20 --check true --json \
          | jl bin=$b tree=$t kv=$heads >> "$R/tree.jsonl"
      done
    done
  done
  log "trees done"

  for j in "mma 2" "auto 0"; do
    set -- $j
    l=$(left); [ "$l" -lt 60 ] && { log "SKIPPED selftest $j (time)"; continue; }
    log "selftest --backend cuda --ranks 1 --cases $2 --kernel $1 (cap $((l - 5))s)"
    s=$SECONDS
    timeout $((l - 5)) $BIN selftest --backend cuda --ranks 1 --cases $2 --kernel $1 2>&1 | tail -8
    echo "exit ${PIPESTATUS[0]} after $((SECONDS - s))s"
  done 2>&1 | tee "$R/selftest.txt"

  log "summary"
  python3 - "$R" <<'PY'
import json, math, os, sys
r = sys.argv[1]
def load(n):
    p = os.path.join(r, n)
    return json.load(open(p)) if os.path.exists(p) else None
for shape in ("LLAMA", "SMOL", "MHA", "batch4"):
    new, old = load(f"kernel_{shape}_new.json"), load(f"kernel_{shape}_base.json")
    if not new:
        continue
    o = {p["seq_len"]: p for p in (old or {}).get("points", [])}
    print(f"kernel {shape}: copy {new['copy_gbps']:.0f} GB/s")
    for p in new["points"]:
        b = o.get(p["seq_len"])
        print(f"  N={p['seq_len']:>7} new {p['median_ms']*1e3:7.1f} us (stage 1 {p['stage1_ms']*1e3:7.1f}, groups {p['groups']}, "
              f"{100*p['fraction_of_copy']:.1f}% of copy, floor {p['floor_ms']*1e3:.1f}, KV floor {p['kv_floor_ms']*1e3:.1f}, err {p.get('rel_error')})"
              + (f" | base {b['median_ms']*1e3:7.1f} us ({100*b['fraction_of_copy']:.1f}%, floor {b['floor_ms']*1e3:.1f}, groups {b['groups']})" if b else ""))
rows = {}
p = os.path.join(r, "tree.jsonl")
for line in (open(p) if os.path.exists(p) else []):
    d = json.loads(line)
    for m in d["methods"]:
        rows.setdefault((d["kv"], d["tree"], m["method"]), {})[d["bin"]] = (m["median_us"], m.get("stage1_us"), m.get("chosen"), m.get("rel_error"), d.get("kv_floor_us"))
ratios = {}
for (kv, t, m), v in sorted(rows.items(), key=lambda x: (int(x[0][0]), int(x[0][1]), x[0][2])):
    if "new" in v and "base" in v:
        ratios.setdefault((kv, m), []).append(v["new"][0] / v["base"][0])
        print(f"tree {t} 32/{kv} {m}: new {v['new'][0]:.1f} (s1 {v['new'][1] or 0:.1f}, {v['new'][2]}) base {v['base'][0]:.1f} (s1 {v['base'][1] or 0:.1f}, {v['base'][2]}) err new {v['new'][3]} base {v['base'][3]} floor {v['new'][4]:.1f}")
for (kv, m), xs in sorted(ratios.items()):
    g = math.exp(sum(map(math.log, xs)) / len(xs))
    print(f"trees 32/{kv} {m}: geomean new/base {g:.3f} over {len(xs)} (min {min(xs):.3f}, max {max(xs):.3f})")
PY
  grep -h 'selftest\|^exit\|pass\|FAIL' "$R/selftest.txt" | head -20
} 2>&1 | tee "$OUT/log.txt"
