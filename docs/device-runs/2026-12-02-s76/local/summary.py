"""Tables of ab-attention.sh's runs: each build's values per round, in turn."""
import glob, re, collections

names = ["base", "exp", "l2", "final"]
decode = collections.defaultdict(list)   # (name, context) -> median steps
timing = collections.defaultdict(list)   # (name, run, what) -> values
for path in sorted(glob.glob("runs/*.txt")):
    run, name, rnd = re.match(r"runs/(\w+)-(\w+)-(\d)\.txt", path).groups()
    text = open(path).read()
    if run == "decode":
        for line in text.splitlines():
            f = line.split()
            if f and f[0].isdigit() and len(f) > 10:
                decode[(name, int(f[0]))].append(float(f[9]))
        continue
    last = next(l for l in reversed(text.splitlines()) if l.startswith("weights loaded"))
    median = re.search(r"median step ([0-9.]+) ms", last)
    prefill = re.search(r"prefill ([0-9.]+) s", last)
    if median:
        timing[(name, run, "median step ms")].append(float(median.group(1)))
    if run.startswith("prompt"):
        timing[(name, run, "prefill s")].append(float(prefill.group(1)))

print("| context | " + " | ".join(f"`{n}`" for n in names) + " |")
print("|---" * (len(names) + 1) + "|")
for ctx in sorted({c for _, c in decode}):
    print(f"| {ctx} | " + " | ".join(", ".join(f"{v:.1f}" for v in decode[(n, ctx)]) for n in names) + " |")
print()
runs = sorted({(r, w) for _, r, w in timing})
print("| run | " + " | ".join(f"`{n}`" for n in names) + " |")
print("|---" * (len(names) + 1) + "|")
for r, w in runs:
    print(f"| {r}, {w} | " + " | ".join(", ".join(f"{v:g}" for v in timing[(n, r, w)]) for n in names) + " |")
