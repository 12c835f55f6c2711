#!/usr/bin/env bash
# Session 47, call 6 (one H200): the q|k|v product of a 16-bit weight on cuBLAS held in bf16
# (variants/narrow-qkv.patch on 2cd5ceb) against the fp32 product (canopy-base, d21c590's
# build): the kernels' compile, the device tests (with the patch's RoPE-op tests), the 8B
# prefill at 32K and 127K alternating, then model-check.sh in the time left.
set -uo pipefail
source launch/device/env.sh
export OUT
nvidia-smi --query-gpu=name,memory.total,driver_version,power.limit --format=csv,noheader | tee "$OUT/gpu.txt"
$BIN compile-kernels 2>&1 | tail -2 | tee "$OUT/compile.txt"
device_tests > /dev/null
grep -E "test result|FAIL|panicked|max error|bit for bit: false" $OUT/tests.txt | head -40
summ() { python3 -c 'import json,sys
r=json.load(open(sys.argv[1]))
for x in r["rows"]: print(sys.argv[2], x["context"], "fill_s %.4f" % x["fill_s"], "tflops %.0f" % x["prefill_tflops_per_device"])' "$1" "$2"; }
for round in 1 2; do
  for side in base new; do
    bin=$BIN; [ $side = base ] && bin=.device/canopy-base
    CANOPY_KERNEL_CACHE=/tmp/kc-$side $bin bench decode --arch llama-3.1-8b --random-weights --context 32K,127K \
      --ranks 1 --strategy tree --decode 3 --json > "$OUT/prefill-$side-$round.json" 2> "$OUT/prefill-$side-$round.err"
    summ "$OUT/prefill-$side-$round.json" "prefill $side r$round" | tee -a "$OUT/prefill.txt"
  done
done
left=$((560 - SECONDS))
echo "model-check with DEADLINE=$((left - 30)) at ${SECONDS}s"
mkdir -p $OUT/mc
DEADLINE=$((left - 30)) OUT=$OUT/mc timeout $left bash launch/device/model-check.sh > /dev/null 2>&1
echo "model-check exit $?"; tail -3 $OUT/mc/model-check-log.txt
cd $OUT && tar czf all.tgz *.txt *.json *.err mc 2>/dev/null && rm -rf *.json *.err mc
