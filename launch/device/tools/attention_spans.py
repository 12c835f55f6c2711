"""The decode attention's time per layer inside a model's step, from cupti_trace.c's lines.

usage: attention_spans.py TRACE.tsv KV_BYTES_PER_LAYER COPY_GB_S [LAUNCHES]

Over the last LAUNCHES (default 160) launches of the split-KV attention (`decode_partial*`)
on GPU 0: the kernel's own time, and the span from its start to the end of the merge that
follows it (`merge_partials*`, where the plan has one), each as a median in µs and as a share
of the copy bandwidth (KV_BYTES_PER_LAYER / COPY_GB_S over the time). The span is the
attention's cost to the step: the merge is launched early and overlaps the kernel.
"""

import statistics
import sys


def main():
    trace, kv_bytes, gb_s = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
    last = int(sys.argv[4]) if len(sys.argv) > 4 else 160
    gpu = []
    for line in open(trace):
        kind, start, end, name, device = line.rstrip("\n").split("\t")
        if kind == "K" and device == "0":
            gpu.append((int(start), int(end), name))
    gpu.sort()
    kernel, span = [], []
    for i, (s, e, name) in enumerate(gpu):
        if not name.startswith("decode_partial"):
            continue
        end = e
        for s2, e2, n2 in gpu[i + 1 : i + 8]:
            if n2.startswith("decode_partial"):
                break
            if n2.startswith("merge_partials"):
                end = max(end, e2)
                break
        kernel.append((e - s) / 1e3)
        span.append((end - s) / 1e3)
    if not kernel:
        print("no decode_partial launches in the trace")
        return
    kernel, span = kernel[-last:], span[-last:]
    floor_us = kv_bytes / (gb_s * 1e9) * 1e6
    for what, xs in (("kernel", kernel), ("kernel + merge", span)):
        m = statistics.median(xs)
        print(f"{what}: median {m:.1f} us over {len(xs)} launches (p10 {sorted(xs)[len(xs) // 10]:.1f}, "
              f"p90 {sorted(xs)[len(xs) * 9 // 10]:.1f}); KV floor {floor_us:.1f} us; "
              f"{100 * floor_us / m:.1f}% of copy bandwidth")


main()
