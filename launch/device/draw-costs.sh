#!/usr/bin/env bash
# Where a served step's draws spend the host's time: `canopy bench serve` on the 8B shape with
# random weights (few-shot: 128 requests behind one 4K-token prompt, 64 at a time, 128 tokens
# each) for each SAMPLINGS entry (name=options, `_` for a space), with the scheduler's debug
# lines on; the "draws" lines of steps with rows have their phases averaged (draw_ms: the
# draws from narrowed rows; tails_ms: the walks past them on the device; read_ms, redraw_ms:
# rows read whole), beside the run's shares of its steps. With LOGS_ONLY=1 it only summarizes
# the logs an earlier run left in /tmp. Results: $OUT/draw-costs.txt.
set -uo pipefail
source "$(dirname "$0")/env.sh"
SAMPLINGS=${SAMPLINGS:-greedy=--temperature_0 t1=--temperature_1 top-p=--temperature_1_--top-p_0.9}
# summarize JSON LOG: the run's throughput and step shares, and its draws' phases.
summarize() {
  python3 - "$1" "$2" <<'PY'
import json, re, sys
r = json.load(open(sys.argv[1]))
s = r["steps"]
print(f"  {r['output_throughput']:.0f} output tokens/s, TPOT median {r['tpot_ms']['median']:.2f} ms; "
      f"{s['busy_steps']} steps of {s['mean_step_ms']:.2f} ms: decode {s['decode_share']:.3f}, "
      f"prefill {s['prefill_share']:.3f}, other {s['other_share']:.3f}")
phases, n = {}, 0
for line in open(sys.argv[2]):
    line = re.sub(r"\x1b\[[0-9;]*m", "", line)
    if " draws " not in line or " rows=0 " in line:
        continue
    n += 1
    for k, v in re.findall(r"(\w+_ms)=([0-9.e-]+)", line):
        phases[k] = phases.get(k, 0.0) + float(v)
print(f"  {n} steps drawing rows; ms a step: " + ", ".join(f"{k} {v / max(n, 1):.3f}" for k, v in phases.items()))
PY
}
{
  [ -n "${LOGS_ONLY:-}" ] || $BIN compile-kernels > /dev/null 2>&1 || echo "compile-kernels FAILED"
  for entry in $SAMPLINGS; do
    name=${entry%%=*} opts=${entry#*=}
    log "$name (${opts//_/ })"
    [ -n "${LOGS_ONLY:-}" ] || RUST_LOG=canopy_runtime::serving=debug $BIN bench serve \
      --arch llama-3.1-8b --random-weights --backend cuda --max-context 8192 --kv-tokens 131072 \
      --max-batch 64 --dataset few-shot --prefix-len 4096 --num-prompts 128 --max-concurrency 64 \
      --output-len 128 ${opts//_/ } --json > "/tmp/$name.json" 2> "/tmp/$name.log"
    summarize "/tmp/$name.json" "/tmp/$name.log"
  done
} 2>&1 | tee "$OUT/draw-costs.txt"
