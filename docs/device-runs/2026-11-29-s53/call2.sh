#!/usr/bin/env bash
# Session 53, call 2 (one H200): the one-warp-per-head CTAs of a cut group claiming the
# group's last quarter of tiles one at a time, only where the group's KV is one range (`new`,
# the working tree on 2455527) against
# `base` (2455527's build). Correctness first (kernel compile, device tests, the conformance
# suite on tensor cores at 1 rank, last, with its time; bench kernel against the f64 oracle),
# the attention alone (bench kernel, Llama shape, batch 1) and inside the 8B step at 32K.
set -uo pipefail
source launch/device/env.sh
export OUT
N=.device/canopy B=.device/canopy-base
$N compile-kernels 2>&1 | tail -1 | tee "$OUT/compile.txt"
{
  for round in 1 2; do
    for bin in $B $N; do
      echo "== $(basename $bin) round $round"
      CANOPY_KERNEL_CACHE=/tmp/k-$(basename $bin) $bin bench kernel --heads 32 --kv-heads 8 --head-dim 128 \
        --dtype bf16 --seq-lens 8192,32768,131072 --iters 30 2>&1 | tail -6
    done
  done
} 2>&1 | tee "$OUT/kernel.txt"
for bin in $B $N; do
  echo "== $(basename $bin)" >> "$OUT/in-step.txt"
  CANOPY_KERNEL_CACHE=/tmp/k-$(basename $bin) CANOPY_BIN=$bin CONTEXTS="32K" DECODE=12 OUT=/tmp/ais \
    bash launch/device/attention-in-step.sh > /dev/null 2>&1
  grep -vE "^==|CUPTI" /tmp/ais/attention-in-step.txt | tail -6 >> "$OUT/in-step.txt"
done
cat "$OUT/in-step.txt"
start=$SECONDS
timeout 250 $N selftest --backend cuda --ranks 1 --cases 1 --kernel mma > "$OUT/selftest-full.txt" 2>&1
echo "selftest rc $? in $((SECONDS - start)) s: $(grep -E "passed|failed" "$OUT/selftest-full.txt" | tail -2)" | tee "$OUT/selftest.txt"
grep -E "FAIL" "$OUT/selftest-full.txt" | head -5 >> "$OUT/selftest.txt"
tail -3 "$OUT/selftest-full.txt"
