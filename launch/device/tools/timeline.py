"""Where a prefill's (or decode steps') wall time goes, from cupti_trace.c's lines.

usage: timeline.py TRACE.tsv [MIN_ATTENTION_LAUNCHES]
       timeline.py TRACE.tsv --steps KERNEL N
       timeline.py TRACE.tsv --passes KERNEL MARKS

With --passes, the trace is cut into passes at each launch of KERNEL (a pass's first kernel,
e.g. embed_rows), and the passes that launch any of MARKS (comma-separated names, e.g.
prefill_attention,causal_attention: a pass with prompt chunks) are told from the rest; for each
kind, medians of a pass's span (to the next pass's first kernel), its GPU busy time and its
longest idle gap (where the host works between passes, between the logits' copy and the next
pass's inputs) with the driver calls inside it, the host's driver calls made meanwhile, and
the idle gaps under 100 us by the work either side, and the GPU time by name a pass.

With --steps, the window is the last N intervals between the ends of KERNEL's launches (a
decode step's marker, e.g. top_logits, which a step launches twice: two intervals a step); GPU
time by name is then per interval.

The prefill is the last MIN_ATTENTION_LAUNCHES (default 125: 32 layers of 4 chunks, less
the last layer of the first 3)
`prefill_attention` launches of the last run of them less than a second apart; its window runs
from the first of them to the last.
Only GPU 0's work is read (rank 0's, where ranks have a GPU each). Prints the window's wall
time, the time the GPU ran kernels, copies or memsets (their union),
its idle time in gaps by size, the longest gaps with the work either side and the host driver
calls over 20 us that overlapped them, GPU time by kernel name, and host time by driver call.
"""

import sys
from collections import Counter, defaultdict


def main():
    gpu, api = [], []
    for line in open(sys.argv[1]):
        kind, start, end, name, device = line.rstrip("\n").split("\t")
        if kind == "D":
            api.append((int(start), int(end), name))
        elif device == "0":
            gpu.append((int(start), int(end), name))
    gpu.sort()
    api.sort()
    if sys.argv[2:3] == ["--steps"]:
        marker, n = sys.argv[3], int(sys.argv[4])
        ends = [e for s, e, name in gpu if name == marker]
        if len(ends) < n + 1:
            print(f"fewer than {n + 1} launches of {marker}")
            return
        report(gpu, api, ends[-n - 1], ends[-1], n, f"{n} intervals of {marker}")
        return
    if sys.argv[2:3] == ["--passes"]:
        passes(gpu, api, sys.argv[3], sys.argv[4])
        return
    least = int(sys.argv[2]) if len(sys.argv) > 2 else 125
    runs, run = [], []
    for k in (k for k in gpu if k[2] == "prefill_attention"):
        if run and k[0] - run[-1][1] > 1e9:
            runs.append(run)
            run = []
        run.append(k)
    runs = [r for r in runs + [run] if len(r) >= least]
    if not runs:
        print(f"no run of {least} prefill_attention launches")
        return
    # A warm-up's launches may run into the prefill's: the prefill is the run's last `least`.
    run = runs[-1][-least:]
    report(gpu, api, run[0][0], run[-1][1], 1, f"{len(run)} attention launches")


def passes(gpu, api, first, marks):
    """Passes cut at each `first` launch, told apart by whether they launch one of `marks`."""
    mark = set(marks.split(","))
    starts = [s for s, e, name in gpu if name == first]
    kinds = defaultdict(list)
    for lo, hi in zip(starts, starts[1:]):
        inside = [w for w in gpu if lo <= w[0] < hi]
        busy, end, longest, gap, gaps, prev = 0, lo, 0, (lo, lo), [], "start"
        for s, e, name in inside:
            if s > end:
                gaps.append((s - end, prev, name))
            if s - end > longest:
                longest, gap = s - end, (end, s)
            if e > end:
                busy += e - max(s, end)
                end, prev = e, name
        if hi - end > longest:
            longest, gap = hi - end, (end, hi)
        kind = "with" if any(n in mark for _, _, n in inside) else "without"
        calls = [c for c in api if lo <= c[0] < hi]
        in_gap = [(max(a, gap[0]), min(b, gap[1]), n) for a, b, n in calls if b > gap[0] and a < gap[1]]
        kinds[kind].append((hi - lo, busy, longest, inside, calls, in_gap, gaps))
    for kind, runs in kinds.items():
        n = len(runs)
        med = [sorted(r[i] for r in runs)[n // 2] / 1e6 for i in range(3)]
        print(f"passes {kind} {marks}: {n}, medians: span {med[0]:.2f} ms, GPU busy "
              f"{med[1]:.2f} ms, its longest idle gap {med[2]:.2f} ms")
        held = defaultdict(lambda: [0, 0])
        for *_, in_gap, _ in runs:
            for a, b, name in in_gap:
                held[name][0] += 1
                held[name][1] += b - a
        print("  host driver calls inside the longest idle gap a pass (ms, count):")
        for name, (c, t) in sorted(held.items(), key=lambda x: -x[1][1])[:6]:
            print(f"  {t / 1e6 / n:9.3f} {c / n:8.1f}  {name}")
        host = defaultdict(lambda: [0, 0])
        for *_, calls, _, _ in runs:
            for a, b, name in calls:
                host[name][0] += 1
                host[name][1] += b - a
        total = sum(t for _, t in host.values())
        print(f"  host driver calls a pass (ms, count; the calls made while the pass's window "
              f"ran, {total / 1e6 / n:.2f} ms in all):")
        for name, (c, t) in sorted(host.items(), key=lambda x: -x[1][1])[:8]:
            print(f"  {t / 1e6 / n:9.3f} {c / n:8.1f}  {name}")
        between = defaultdict(lambda: [0, 0])
        for *_, gaps in runs:
            for d, before, after in gaps:
                if d < 100_000:
                    between[(before[:28], after[:28])][0] += 1
                    between[(before[:28], after[:28])][1] += d
        idle = sum(t for _, t in between.values())
        print(f"  idle gaps under 100 us a pass, by the work either side ({idle / 1e6 / n:.3f} ms "
              f"in all; ms, count, mean us):")
        for (a, b), (c, t) in sorted(between.items(), key=lambda x: -x[1][1])[:14]:
            print(f"  {t / 1e6 / n:9.3f} {c / n:8.1f} {t / c / 1e3:6.1f}  {a} -> {b}")
        by_name = defaultdict(lambda: [0, 0])
        for _, _, _, inside, _, _, _ in runs:
            for s, e, name in inside:
                by_name[name[:60]][0] += 1
                by_name[name[:60]][1] += e - s
        print("  GPU time by name a pass (ms, count):")
        for name, (c, t) in sorted(by_name.items(), key=lambda x: -x[1][1])[:20]:
            print(f"  {t / 1e6 / n:9.3f} {c / n:8.1f}  {name}")


def report(gpu, api, lo, hi, per, what):
    """The window lo..hi (ns) of `gpu` and `api` records; GPU time by name divided by `per`."""
    inside = [w for w in gpu if w[0] >= lo and w[1] <= hi]
    busy, gaps, end, prev = 0, [], lo, "start"
    for s, e, name in inside:
        if s > end:
            gaps.append((s - end, end, s, prev, name))
        if e > end:
            busy += e - max(s, end)
            end = e
            prev = name
    wall, idle = hi - lo, sum(g[0] for g in gaps)
    print(f"window: {what}, {wall / 1e6:.1f} ms wall, {busy / 1e6:.1f} ms "
          f"busy ({100 * busy / wall:.1f}%), {idle / 1e6:.1f} ms idle in {len(gaps)} gaps")
    for a, b in [(0, 2e3), (2e3, 1e4), (1e4, 1e5), (1e5, 1e6), (1e6, 1e12)]:
        sel = [g[0] for g in gaps if a <= g[0] < b]
        print(f"  gaps of {a / 1e3:g}-{b / 1e3:g} us: {len(sel)}, {sum(sel) / 1e6:.2f} ms")
    slow = [c for c in api if c[1] - c[0] > 20_000]
    print("longest gaps (us): work before -> after [driver calls over 20 us overlapping]")
    for d, s, e, before, after in sorted(gaps, reverse=True)[:30]:
        over = Counter(n for a, b, n in slow if b > s and a < e)
        calls = ", ".join(f"{n} x{c}" for n, c in over.most_common(4))
        print(f"  {d / 1e3:9.1f}  {before[:40]} -> {after[:40]}  [{calls}]")
    by_name = defaultdict(lambda: [0, 0])
    for s, e, name in inside:
        by_name[name[:60]][0] += 1
        by_name[name[:60]][1] += e - s
    print(f"GPU time by name in the window (ms, count; per {per} of the window):")
    for name, (n, t) in sorted(by_name.items(), key=lambda x: -x[1][1])[:24]:
        print(f"  {t / 1e6 / per:9.3f} {n / per:8.1f}  {name}")
    host, longest = Counter(), Counter()
    for a, b, n in api:
        if a >= lo and b <= hi:
            host[n] += b - a
            longest[n] = max(longest[n], b - a)
    print("host driver calls in the window (total ms, longest us):")
    for n, t in host.most_common(14):
        print(f"  {t / 1e6:9.2f} {longest[n] / 1e3:9.1f}  {n}")


main()
