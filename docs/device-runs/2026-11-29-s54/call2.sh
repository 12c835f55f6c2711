#!/usr/bin/env bash
# Session 54, call 2 (one H200): the build of 69ea644 (weights read a part at a time straight
# into the upload's page-locked buffers) checked against transformers and under
# compute-sanitizer: model-check.sh (fixtures, a tiny device model and the 8B shape at 4
# layers, 1-4 ranks, tree and ring), then sanitizer.sh (memcheck, racecheck, initcheck).
# Then the host-to-device copy rate from page-locked memory (torch, 1 GiB buffers), the floor
# of a warm upload.
set -uo pipefail
source launch/device/env.sh
export OUT
DEADLINE=330 OUT=/tmp/mc bash launch/device/model-check.sh > /tmp/mc-log.txt 2>&1
tail -4 /tmp/mc-log.txt | tee "$OUT/model-check-tail.txt"
cp /tmp/mc/model-check.txt /tmp/mc/model-check.json "$OUT/" 2>/dev/null
tar czf "$OUT/model-check-log.tgz" -C /tmp mc-log.txt mc/canopy-stderr.log mc/reference.log 2>/dev/null
OUT=/tmp/san bash launch/device/sanitizer.sh > /dev/null 2>&1
cat /tmp/san/sanitizer.txt | tee "$OUT/sanitizer.txt"
tar czf "$OUT/sanitizer-runs.tgz" -C /tmp san
python3 - <<'PY' | tee "$OUT/h2d.txt"
import time, torch
src = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
dst = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
for _ in range(2):
    dst.copy_(src, non_blocking=True)
torch.cuda.synchronize()
rates = []
for _ in range(5):
    t0 = time.perf_counter()
    for _ in range(4):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    rates.append(4 * (1 << 30) / (time.perf_counter() - t0) / 1e9)
print("host-to-device from page-locked memory, GB/s:", " ".join(f"{r:.1f}" for r in rates))
PY
