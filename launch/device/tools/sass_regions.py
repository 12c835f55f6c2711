"""Where a kernel's sampled warp stalls fall, from Nsight Compute's source page as CSV
(`ncu -i REPORT --page source --print-source sass --csv`, plain or gzipped).

usage: sass_regions.py SOURCE.csv[.gz] [TOP]

Instructions executed the same number of times (per launch, summed over warps) run as one
piece of code: a kernel's prologue runs once a warp, a loop's body once a warp and trip, and
code that only some CTAs take runs as often as those CTAs' warps. So the instructions are
grouped by their execution count, and each group is printed with its instruction count, its
share of the stall samples and its leading stall reasons, largest share first, then the TOP
(default 15) instructions that drew the most samples, with their line in the listing.
"""

import csv
import gzip
import sys
from collections import Counter, defaultdict

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def rows(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        table = list(csv.reader(f))
    # The page starts with the kernel's name, then the header.
    header_at = next(i for i, r in enumerate(table) if SAMPLES in r)
    header = table[header_at]
    return header, table[header_at + 1 :]


def number(cell):
    try:
        return int(cell)
    except ValueError:
        return 0


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    header, body = rows(sys.argv[1])
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 15
    col = {name: i for i, name in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    total = sum(number(r[col[SAMPLES]]) for r in body)
    if total == 0:
        sys.exit("no stall samples in the page")
    groups = defaultdict(lambda: [0, 0, Counter()])  # count -> instructions, samples, reasons
    for r in body:
        g = groups[number(r[col[EXECUTED]])]
        g[0] += 1
        g[1] += number(r[col[SAMPLES]])
        for h in reasons:
            g[2][h[len("stall_") :]] += number(r[col[h]])
    print(f"{len(body)} instructions, {total} samples")
    print(f"{'executed':>10} {'instrs':>7} {'samples':>8} {'share':>6}  leading stalls")
    for count, (instrs, samples, why) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
        if samples == 0:
            continue
        lead = ", ".join(f"{k} {v}" for k, v in why.most_common(3) if v)
        print(f"{count:>10} {instrs:>7} {samples:>8} {100 * samples / total:>5.1f}%  {lead}")
    print(f"\nthe {top} instructions with the most samples (line, executed, samples, SASS):")
    ranked = sorted(enumerate(body), key=lambda ir: -number(ir[1][col[SAMPLES]]))
    for line, r in ranked[:top]:
        print(f"{line:>6} {number(r[col[EXECUTED]]):>8} {number(r[col[SAMPLES]]):>5}  {r[col['Source']].strip()}")


if __name__ == "__main__":
    main()
