"""A generation's decode steps, from the runtime's debug log (RUST_LOG=canopy_runtime=debug).

usage: steps.py LOG

Prints one character a step in order (R: replayed from the recorded graph, .: run op by op
or recorded), then for each kind the count and the pass time (median, mean, max ms) with the
host's books and layout before it. A replayed pass's time is the GPU's step with the launch
(the runtime waits for the logits), so the replayed median is the steady step, and the
others show what recording and running op by op cost.
"""
import re
import sys

ANSI = re.compile(r"\x1b\[[0-9;]*m")
FIELD = re.compile(r"(\w+)=([\w.]+)")


def main():
    steps = []
    with open(sys.argv[1]) as log:
        for line in log:
            line = ANSI.sub("", line)
            if "decode step" not in line:
                continue
            f = dict(FIELD.findall(line))
            host = float(f["books_ms"]) + float(f["layout_ms"])
            steps.append((f.get("replayed") == "true", float(f["pass_ms"]), host))
    print("".join("R" if replayed else "." for replayed, _, _ in steps))
    for replayed, name in ((True, "replayed"), (False, "op by op / recorded")):
        kind = [s for s in steps if s[0] == replayed]
        if not kind:
            continue
        passes = sorted(s[1] for s in kind)
        host = sum(s[2] for s in kind) / len(kind)
        print(
            f"{name}: {len(kind)} steps, pass ms median {passes[len(passes) // 2]:.2f} "
            f"mean {sum(passes) / len(passes):.2f} max {passes[-1]:.2f}; "
            f"books+layout mean {host:.2f}"
        )


if __name__ == "__main__":
    main()
