"""Tables of this session's CPU decode runs: the device machine's (callN.txt) and this host's
(local/runs/). Prints markdown: the median step (ms a token) of each build, round by round."""
import glob
import os
import re
import sys
from collections import defaultdict

here = os.path.dirname(os.path.abspath(__file__))


def device_table(name):
    rows = defaultdict(list)  # (arch, context, build) -> medians in round order
    arch = build = None
    for line in open(os.path.join(here, name)):
        m = re.match(r"== round (\d+), (\w+), (\S+)", line)
        if m:
            build, arch = m.group(2), m.group(3)
            continue
        f = line.split()
        if f and f[0].isdigit() and arch:
            rows[(arch, int(f[0]), build)].append(float(f[9]))
    print(f"\n{name}: median step, ms a token (rounds 1, 2, 3)\n")
    print("| shape | context | `base` | `new` |")
    print("|---|---|---|---|")
    for arch, ctx in sorted({(a, c) for a, c, _ in rows}):
        cell = lambda b: ", ".join(f"{x:.1f}" for x in rows[(arch, ctx, b)])
        print(f"| {arch} | {ctx} | {cell('base')} | {cell('new')} |")


def local_table():
    runs = os.path.join(here, "local", "runs")
    decode = defaultdict(list)
    other = defaultdict(list)
    for path in sorted(glob.glob(os.path.join(runs, "*.txt"))):
        kind, name, _ = os.path.basename(path)[:-4].split("-")
        text = open(path).read()
        if kind == "decode":
            for line in text.splitlines():
                f = line.split()
                if f and f[0].isdigit() and len(f) > 9:
                    decode[(int(f[0]), name)].append(float(f[9]))
        else:
            m = re.search(r"median step ([\d.]+) ms", text)
            p = re.search(r"prefill ([\d.]+) s", text)
            if m:
                other[(kind, "median step ms", name)].append(float(m.group(1)))
            if p and kind.startswith("prompt"):
                other[(kind, "prefill s", name)].append(float(p.group(1)))
    names = sorted({n for _, n in decode} | {n for _, _, n in other}, key=["base", "rows"].index)
    print("\nthis host: bench decode, median step, ms a token (rounds in order)\n")
    print("| context | " + " | ".join(f"`{n}`" for n in names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for ctx in sorted({c for c, _ in decode}):
        print(f"| {ctx} | " + " | ".join(", ".join(f"{x:.1f}" for x in decode[(ctx, n)]) for n in names) + " |")
    print("\n| run | " + " | ".join(f"`{n}`" for n in names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for kind, what in sorted({(k, w) for k, w, _ in other}):
        print(f"| {kind}, {what} | " + " | ".join(", ".join(f"{x:g}" for x in other[(kind, what, n)]) for n in names) + " |")


for name in sys.argv[1:] or ["call1.txt", "call2.txt"]:
    device_table(name)
if os.path.isdir(os.path.join(here, "local", "runs")):
    local_table()
