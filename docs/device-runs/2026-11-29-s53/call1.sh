#!/usr/bin/env bash
# Session 53, call 1 (one H200): the one-warp-per-head CTAs of a cut group claiming the
# group's last quarter of tiles one at a time (`new`, the working tree on 2455527) against
# `base` (2455527's build). Correctness first (kernel compile, device tests, the conformance
# suite on tensor cores at 1 and 2 ranks, bench kernel against the f64 oracle), then the
# attention alone (bench kernel, Llama shape, batch 1) and inside the 8B step at 32K.
set -uo pipefail
source launch/device/env.sh
export OUT
N=.device/canopy B=.device/canopy-base
$N compile-kernels 2>&1 | tail -1 | tee "$OUT/compile.txt"
device_tests > /dev/null 2>&1
grep -E "test result|FAIL|panicked" "$OUT/tests.txt"
timeout 200 $N selftest --backend cuda --ranks 1,2 --cases 1 --kernel mma > /tmp/st.txt 2>&1
echo "selftest rc $?: $(grep -E "passed|failed" /tmp/st.txt | tail -2)" | tee "$OUT/selftest.txt"
grep -E "FAIL" /tmp/st.txt | head -5 >> "$OUT/selftest.txt"
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
