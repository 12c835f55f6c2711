#!/usr/bin/env bash
# Each kernel's mean duration (Nsight Compute, kernels serialised, clocks as run) over COUNT
# launches of a batch-1 decode (`bench decode --eager`, 8B shape, 8K, random weights and
# context) after SKIP, for every binary in BINS ("name=path ..."): which kernels a variant made
# faster or slower, apart from how they overlap in the step. Results: $OUT/kernel-times.txt.
set -uo pipefail
source "$(dirname "$0")/env.sh"
NCU=${NCU:-/usr/local/cuda/bin/ncu}
{
  for entry in ${BINS:-new=$BIN}; do
    name=${entry%%=*} bin=${entry#*=}
    echo "== $name"
    CANOPY_KERNEL_CACHE=/tmp/canopy-kernels-$name $NCU --metrics gpu__time_duration.sum --csv \
      --launch-skip "${SKIP:-600}" --launch-count "${COUNT:-400}" --clock-control none \
      $bin bench decode --arch llama-3.1-8b --random-weights --context-fill random --context 8K \
      --ranks 1 --strategy tree --decode 8 --eager 2>/dev/null \
      | python3 -c '
import csv, sys, collections
rows = [r for r in csv.reader(sys.stdin) if len(r) > 10]
head = rows[0]; k = head.index("Kernel Name"); v = head.index("Metric Value")
t = collections.defaultdict(list)
for r in rows[1:]:
    t[r[k]].append(float(r[v].replace(",", "")) / 1000)
for name, us in sorted(t.items(), key=lambda x: -sum(x[1])):
    print(f"{name:32s} {len(us):5d} launches  mean {sum(us)/len(us):8.2f} us  total {sum(us):9.1f} us")'
  done
} 2>&1 | tee "$OUT/kernel-times.txt"
