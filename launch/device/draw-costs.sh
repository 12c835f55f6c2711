#!/usr/bin/env bash
# Where a served step spends the host's time: `canopy bench serve` on the 8B shape with random
# weights (few-shot: 128 requests behind one 4K-token prompt, 64 at a time, 128 tokens each)
# for each SAMPLINGS entry (name=options, `_` for a space), with the runtime's debug lines on.
# Per event, the median of each phase over the steps that decode 64 rows and prefill nothing:
# - "serve step": schedule_ms (the scheduler's next step), books_ms (pages and rows), pass_ms
#   (the decode pass), observe_ms (draws, stops, streams);
# - "serve decode step": layout_ms (the plan grown or made, the page table), decode_ms (the
#   pass: stage, launch, wait, download), reads_ms (rows read further);
# - "decode pass": launch_ms (inputs staged, the pass launched), download_ms (the GPU's wait
#   and the logits' copy);
# - "draws": draw_ms (draws from narrowed rows), tails_ms (walks past them on the device),
#   read_ms and redraw_ms (rows read whole);
# beside the run's throughput and shares of its steps. MODEL, PREFIX and OUTPUT replace the
# server's model options, the prompt's shared prefix and the output length. With LOGS_ONLY=1
# it only summarizes the logs an earlier run left in /tmp. Results: $OUT/draw-costs.txt.
set -uo pipefail
source "$(dirname "$0")/env.sh"
MODEL=${MODEL:---arch llama-3.1-8b --random-weights --backend cuda --max-context 8192 --kv-tokens 131072}
PREFIX=${PREFIX:-4096} OUTPUT=${OUTPUT:-128}
SAMPLINGS=${SAMPLINGS:-greedy=--temperature_0 t1=--temperature_1 top-p=--temperature_1_--top-p_0.9}
# summarize JSON LOG: the run's throughput and step shares, and its steps' phases.
summarize() {
  python3 - "$1" "$2" <<'PY'
import json, re, statistics, sys
r = json.load(open(sys.argv[1]))
s = r["steps"]
print(f"  {r['output_throughput']:.0f} output tokens/s, TPOT median {r['tpot_ms']['median']:.2f} ms; "
      f"{s['busy_steps']} steps of {s['mean_step_ms']:.2f} ms: decode {s['decode_share']:.3f}, "
      f"prefill {s['prefill_share']:.3f}, other {s['other_share']:.3f}")
events = {"serve step": {}, "serve decode step": {}, "decode pass": {}, "draws": {}}
for line in open(sys.argv[2]):
    line = re.sub(r"\x1b\[[0-9;]*m", "", line)
    name = next((e for e in events if line.rstrip().endswith(" " + e) or f" {e} " in line), None)
    if name is None:
        continue
    f = dict(re.findall(r"(\w+)=([0-9.e-]+|true|false)", line))
    if name == "serve step" and (float(f["prefill_ms"]) > 0.01 or float(f["pass_ms"]) < 0.5):
        continue
    if name in ("serve decode step", "draws") and f.get("rows") != "64":
        continue
    for k, v in f.items():
        if k.endswith("_ms"):
            events[name].setdefault(k, []).append(float(v))
for name, phases in events.items():
    n = max((len(v) for v in phases.values()), default=0)
    print(f"  {name} ({n}): " + ", ".join(f"{k} {statistics.median(v):.3f}" for k, v in phases.items()))
PY
}
{
  [ -n "${LOGS_ONLY:-}" ] || $BIN compile-kernels > /dev/null 2>&1 || echo "compile-kernels FAILED"
  for entry in $SAMPLINGS; do
    name=${entry%%=*} opts=${entry#*=}
    log "$name (${opts//_/ })"
    [ -n "${LOGS_ONLY:-}" ] || RUST_LOG=canopy_runtime=debug $BIN bench serve $MODEL \
      --max-batch 64 --dataset few-shot --prefix-len $PREFIX --num-prompts 128 --max-concurrency 64 \
      --output-len $OUTPUT ${opts//_/ } --json > "/tmp/$name.json" 2> "/tmp/$name.log"
    summarize "/tmp/$name.json" "/tmp/$name.log"
  done
} 2>&1 | tee "$OUT/draw-costs.txt"
