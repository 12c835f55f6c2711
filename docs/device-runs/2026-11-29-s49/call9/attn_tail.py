"""The attention's launch and its merge inside traced passes: for each of the last N
decode_partial_mma launches on GPU 0, its duration, the gap from the kernel before it, the
merge (the next merge_partials* launch) ending after it, and the gap to the kernel after the
merge. usage: attn_tail.py TRACE.tsv N"""
import sys, statistics

def main():
    gpu = []
    for line in open(sys.argv[1]):
        kind, start, end, name, device = line.rstrip("\n").split("\t")
        if kind != "D" and device == "0" and not name.startswith("memcpy") and not name.startswith("memset"):
            gpu.append((int(start), int(end), name))
    gpu.sort()
    n = int(sys.argv[2])
    idx = [i for i, k in enumerate(gpu) if k[2] == "decode_partial_mma"][-n:]
    rows = []
    for i in idx:
        s, e, _ = gpu[i]
        prev_end = max(k[1] for k in gpu[max(0, i - 8):i])
        merge = next((j for j in range(i + 1, min(i + 6, len(gpu))) if gpu[j][2].startswith("merge_partials")), None)
        if merge is None:
            continue
        ms, me, mname = gpu[merge]
        after = next((k for k in gpu[merge + 1:merge + 8] if k[0] >= ms and not k[2].startswith("merge")), None)
        rows.append(((e - s) / 1e3, (s - prev_end) / 1e3, (me - e) / 1e3, (me - ms) / 1e3,
                     ((after[0] - me) / 1e3) if after else float("nan"), mname, after[2] if after else "-"))
    if not rows:
        print("no attention launches with a merge")
        return
    med = lambda k: statistics.median(r[k] for r in rows)
    pct = lambda k, q: sorted(r[k] for r in rows)[int(len(rows) * q)]
    print(f"{len(rows)} launches; merge {rows[0][5]}, then {rows[0][6]}")
    print(f"  attention kernel, start to end: median {med(0):.2f} us (p10 {pct(0, 0.1):.2f}, p90 {pct(0, 0.9):.2f})")
    print(f"  gap from the kernel before it to its start: median {med(1):.2f} us")
    print(f"  merge's end after the attention's end: median {med(2):.2f} us (p10 {pct(2, 0.1):.2f}, p90 {pct(2, 0.9):.2f}; merge launch start to end {med(3):.2f})")
    print(f"  gap from the merge's end to the next kernel's start: median {med(4):.2f} us")

main()
