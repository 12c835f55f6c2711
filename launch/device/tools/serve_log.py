"""A served run summarized: `canopy bench serve --json`'s report beside the runtime's debug
events (RUST_LOG=canopy_runtime=debug on the bench's own server).

usage: serve_log.py costs REPORT.json LOG
       serve_log.py phases REPORT.json LOG

Both print the run's throughput, latencies and steps' shares. Then `costs` (draw-costs.sh)
prints the median of each phase of the served steps that decode 64 rows and prefill nothing,
by event: "serve step", "serve decode step", "decode pass" and "draws"; `phases`
(serve-phases.sh) sums the run's "prefill pass" events (rows, chunks, the host's planning,
launching and reading) by whether the pass had a cached context, counts its "serve decode
step" events replayed from a recorded pass or not, and sums its "serve step" events that ran
prompt chunks.
"""

import json
import re
import statistics
import sys

EVENT = re.compile(r"^\S+\s+\w+\s+[\w:]+: (.+?)(?= \w+=|$)")
FIELD = re.compile(r"(\w+)=([0-9.e-]+|true|false)")


def events(path):
    """Each debug event of the log at `path`: its message and its numeric or boolean fields."""
    for line in open(path):
        line = re.sub(r"\x1b\[[0-9;]*m", "", line).rstrip()
        m = EVENT.match(line)
        if m:
            yield m.group(1), dict(FIELD.findall(line))


def report(path):
    r = json.load(open(path))
    s = r["steps"]
    print(f"  {r['output_throughput']:.0f} output tokens/s in {r['duration_s']:.2f} s; TTFT median "
          f"{r['ttft_ms']['median']:.0f} ms, p99 {r['ttft_ms']['p99']:.0f}; TPOT median "
          f"{r['tpot_ms']['median']:.2f} ms; ITL median {r['itl_ms']['median']:.2f} ms, p99 "
          f"{r['itl_ms']['p99']:.1f}")
    print(f"  {s['busy_steps']} steps of {s['mean_step_ms']:.2f} ms: decode {s['decode_share']:.3f}, "
          f"prefill {s['prefill_share']:.3f}, other {s['other_share']:.3f}; "
          f"{s['prefill_tokens']} prefill tokens at {s['prefill_tokens_per_s']:.0f}/s")


def costs(log):
    phases = {"serve step": {}, "serve decode step": {}, "decode pass": {}, "draws": {}}
    for name, f in events(log):
        if name not in phases:
            continue
        if name == "serve step" and (float(f["prefill_ms"]) > 0.01 or float(f["pass_ms"]) < 0.5):
            continue
        if name in ("serve decode step", "draws") and f.get("rows") != "64":
            continue
        for k, v in f.items():
            if k.endswith("_ms"):
                phases[name].setdefault(k, []).append(float(v))
    for name, by_phase in phases.items():
        n = max((len(v) for v in by_phase.values()), default=0)
        print(f"  {name} ({n}): "
              + ", ".join(f"{k} {statistics.median(v):.3f}" for k, v in by_phase.items()))


def phases(log):
    passes, decodes, chunked = [], [], []
    for name, f in events(log):
        if name == "prefill pass":
            passes.append(f)
        elif name == "serve decode step":
            decodes.append(f)
        elif name == "serve step" and float(f.get("prefill_ms", 0)) > 0.01:
            chunked.append(f)

    def total(rows, key):
        return sum(float(x[key]) for x in rows)

    for cached in ("true", "false"):
        p = [x for x in passes if x["cached"] == cached]
        if p:
            print(f"  prefill passes, cached context {cached}: {len(p)}, rows {total(p, 'rows'):.0f} "
                  f"(decode {total(p, 'decode_rows'):.0f}), chunks {total(p, 'chunks'):.0f}; ms in "
                  f"all: plan {total(p, 'plan_ms'):.1f}, layers {total(p, 'layers_ms'):.1f}, "
                  f"logits {total(p, 'logits_ms'):.1f}")
    replayed = [d for d in decodes if d["replayed"] == "true"]
    by_hand = [d for d in decodes if d["replayed"] == "false"]
    if decodes:
        def mean(rows):
            return total(rows, "decode_ms") / max(len(rows), 1)
        print(f"  decode steps: {len(replayed)} replayed ({mean(replayed):.2f} ms on average), "
              f"{len(by_hand)} run op by op or recorded ({mean(by_hand):.2f} ms), "
              f"{sum(d['fresh'] == 'true' for d in decodes)} on a layout planned afresh")
    if chunked:
        print(f"  steps with prompt chunks: {len(chunked)}, ms in all: pass "
              f"{total(chunked, 'pass_ms'):.1f}, prefill {total(chunked, 'prefill_ms'):.1f}, "
              f"observe {total(chunked, 'observe_ms'):.1f}")


def main():
    mode, report_path, log = sys.argv[1:4]
    report(report_path)
    {"costs": costs, "phases": phases}[mode](log)


if __name__ == "__main__":
    main()
