#!/usr/bin/env bash
# Where a served run's time goes between decode and prefill: `canopy bench serve` (in process)
# on the 8B shape with random weights, greedy, for each DATASETS × METHODS × CHUNKS
# (`--prefill-chunk`), with the runtime's debug lines on. Per run: its throughput, TTFT and
# inter-token latency, its steps' shares, and its prefill passes (count, rows, the decode rows
# that led them, and the host's milliseconds planning, launching and reading them). MODEL,
# CONCURRENCY, PROMPTS, OUTPUT_LEN and LENGTHS (extra dataset options) override the defaults;
# RATE sets the arrivals (requests a second, Poisson; default all at once), CANOPY_BIN the
# binary. Per run also its decode steps: replayed from a recorded pass, or not. Results:
# $OUT/serve-phases.txt, each run's JSON report in $OUT/phases/.
set -uo pipefail
source "$(dirname "$0")/env.sh"
MODEL=${MODEL:---arch llama-3.1-8b --random-weights --backend cuda --max-context 20480 --kv-tokens 131072}
DATASETS=${DATASETS:-few-shot multi-doc}
METHODS=${METHODS:-auto q-guided}
CHUNKS=${CHUNKS:-512 2048}
C=${CONCURRENCY:-64} N=${PROMPTS:-128} O=${OUTPUT_LEN:-128} LENGTHS=${LENGTHS:-} RATE=${RATE:-inf}
mkdir -p "$OUT/phases"
summarize() {
  python3 - "$1" "$2" <<'PY'
import json, re, sys
r = json.load(open(sys.argv[1]))
s = r["steps"]
print(f"  {r['output_throughput']:.0f} output tokens/s in {r['duration_s']:.2f} s; TTFT median "
      f"{r['ttft_ms']['median']:.0f} ms, p99 {r['ttft_ms']['p99']:.0f}; ITL median "
      f"{r['itl_ms']['median']:.2f} ms, p99 {r['itl_ms']['p99']:.1f}")
print(f"  {s['busy_steps']} steps of {s['mean_step_ms']:.2f} ms: decode {s['decode_share']:.3f}, "
      f"prefill {s['prefill_share']:.3f}, other {s['other_share']:.3f}; "
      f"{s['prefill_tokens']} prefill tokens at {s['prefill_tokens_per_s']:.0f}/s")
passes, steps, decodes = [], [], []
for line in open(sys.argv[2]):
    line = re.sub(r"\x1b\[[0-9;]*m", "", line)
    f = dict(re.findall(r"(\w+)=([0-9.e-]+|true|false)", line))
    if " prefill pass " in line:
        passes.append(f)
    elif " serve decode step " in line:
        decodes.append(f)
    elif " serve step " in line and float(f.get("prefill_ms", 0)) > 0.01:
        steps.append(f)
def total(rows, key):
    return sum(float(p[key]) for p in rows)
for cached in ("true", "false"):
    p = [x for x in passes if x["cached"] == cached]
    if p:
        print(f"  prefill passes, cached context {cached}: {len(p)}, rows {total(p, 'rows'):.0f} "
              f"(decode {total(p, 'decode_rows'):.0f}), chunks {total(p, 'chunks'):.0f}; ms in all: "
              f"plan {total(p, 'plan_ms'):.1f}, layers {total(p, 'layers_ms'):.1f}, "
              f"logits {total(p, 'logits_ms'):.1f}")
replayed = [d for d in decodes if d["replayed"] == "true"]
by_hand = [d for d in decodes if d["replayed"] == "false"]
if decodes:
    mean = lambda rows: total(rows, "decode_ms") / max(len(rows), 1)
    print(f"  decode steps: {len(replayed)} replayed ({mean(replayed):.2f} ms on average), "
          f"{len(by_hand)} run op by op or recorded ({mean(by_hand):.2f} ms), "
          f"{sum(d['fresh'] == 'true' for d in decodes)} on a layout planned afresh")
if steps:
    print(f"  steps with prompt chunks: {len(steps)}, ms in all: pass {total(steps, 'pass_ms'):.1f}, "
          f"prefill {total(steps, 'prefill_ms'):.1f}, observe {total(steps, 'observe_ms'):.1f}")
PY
}
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  $BIN compile-kernels > /dev/null 2>&1 || echo "compile-kernels FAILED"
  for d in $DATASETS; do
    for m in $METHODS; do
      for c in $CHUNKS; do
        name=$d-$m-$c
        log "$d, --method $m, --prefill-chunk $c"
        RUST_LOG=canopy_runtime=debug timeout 200 $BIN bench serve $MODEL --method "$m" \
          --max-batch "$C" --prefill-chunk "$c" --dataset "$d" --num-prompts "$N" \
          --max-concurrency "$C" --output-len "$O" --request-rate "$RATE" $LENGTHS --temperature 0 --json \
          > "$OUT/phases/$name.json" 2> "/tmp/$name.log" || { log "FAILED: $name"; tail -3 "/tmp/$name.log"; continue; }
        summarize "$OUT/phases/$name.json" "/tmp/$name.log"
      done
    done
  done
} 2>&1 | tee "$OUT/serve-phases.txt"
