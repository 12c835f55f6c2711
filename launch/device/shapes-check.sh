#!/usr/bin/env bash
# Shapes beyond the 8B's and SmolLM2's on one GPU: GQA groups of 3, 5 and 7 heads (Llama-3.2-3B
# has 24/8 heads of 128), which leave the tensor-core kernels' blocks of rows short of full.
#   PART=tests  the device tests (the prefill's attention at 24/8 and 28/4 heads of 128 among
#               them), then `selftest --backend cuda --ranks 1,2 --cases 0` (its many-row fans
#               at GQA 3, 5 and 7), which takes about 250 s a kernel choice (KERNELS, default
#               "auto mma");
#   PART=model  `bench tree` on two workloads at 24/8 and 28/4 heads of 128 and 10/2 of 64, every
#               method against the f64 oracle, with the default kernels and the tensor-core one;
#               model-check.sh (its device-made tiny model has 12/4 heads of 128) against
#               transformers; `bench decode --arch llama-3.2-3b --random-weights` at 8K and 32K
#               (prefilled), one rank, beside its floor; `bench kernel` at 32/8 and 24/8 heads
#               of 128 (8K-128K).
#   PART=ab     ab-decode.sh, this build against .device/canopy-old in turn, at Llama-3.2-3B's
#               shape (8K, 32K) and SmolLM2-135M's (4K, 8,000).
# Results under $OUT: tests.txt and tests/, selftest-*.txt, trees.txt, model-check.txt,
# decode-3b.json and .txt, kernel.txt, ab.jsonl and ab.txt. Sections stop being started once
# DEADLINE seconds (default 560) are near.
set -uo pipefail
source "$(dirname "$0")/env.sh"
DEADLINE=${DEADLINE:-560}
PART=${PART:-tests}
case $PART in
tests)
  device_tests > /dev/null 2>&1
  grep -E "test result|prefill_attention_on|FAILED|panicked" "$OUT/tests.txt"
  for kernel in ${KERNELS:-auto mma}; do
    log "selftest --kernel $kernel (cap $(left)s)"
    timeout "$(left)" "$BIN" selftest --backend cuda --ranks 1,2 --cases 0 --kernel "$kernel" \
      > "$OUT/selftest-$kernel.txt" 2>&1
    echo "exit $?"
    grep -E "passed|FAIL" "$OUT/selftest-$kernel.txt" | tail -4
  done
  ;;
model)
  for shape in "24 8 128" "28 4 128" "10 2 64"; do
    read -r h kv d <<< "$shape"
    for workload in fasttree-0 few-shot-b20; do
      for kernel in auto mma; do
        echo "== $workload $h/$kv x $d, kernel $kernel" >> "$OUT/trees.txt"
        "$BIN" bench tree --workload "$workload" --method all --heads "$h" --kv-heads "$kv" \
          --head-dim "$d" --dtype bf16 --backend cuda --kernel "$kernel" --iterations 3 \
          >> "$OUT/trees.txt" 2>&1 || echo "exit $?: $workload $h/$kv x $d $kernel"
      done
    done
  done
  log "trees: the worst relative error of each run"
  awk '/^==/ {name=$0} /^[a-z-]+( \(.*\))? +[0-9]/ {e=$NF+0; if (e > w[name]) w[name]=e} END {for (n in w) print n, w[n]}' \
    "$OUT/trees.txt" | sort
  DEADLINE=$(( DEADLINE - 200 - SECONDS )) bash "$(dirname "$0")/model-check.sh" > "$OUT/model-check.txt" 2>&1
  grep -E "tiny-device|ALL PASS|FAILURES" "$OUT/model-check.txt" | tail -12
  rm -f "$OUT/model-check-runs.tgz" "$OUT"/gen-*
  log "bench decode, llama-3.2-3b"
  timeout $(( DEADLINE - 60 - SECONDS )) "$BIN" bench decode --arch llama-3.2-3b --random-weights \
    --context 8K,32K --decode 20 --backend cuda --json > "$OUT/decode-3b.json" 2> "$OUT/decode-3b.txt"
  echo "exit $?"
  tail -25 "$OUT/decode-3b.txt"
  for heads in 32 24; do
    log "bench kernel, $heads/8 heads of 128"
    timeout $(( DEADLINE - SECONDS )) "$BIN" bench kernel --heads "$heads" --kv-heads 8 \
      --head-dim 128 --dtype bf16 --seq-lens 8192,32768,131072 --iters 30 2>&1 | tail -5 | tee -a "$OUT/kernel.txt"
  done
  ;;
ab)
  # ab-decode.sh: `bench decode` with this build and .device/canopy-old, in turn, ROUNDS
  # rounds: Llama-3.2-3B's shape at 8K and 32K, SmolLM2-135M's at 4K and 8,000 (its positions
  # end at 8,192).
  BINS="canopy=$BIN canopy-old=.device/canopy-old" \
    ARCHS="llama-3.2-3b:8K,32K smollm2-135m:4096,8000" DECODE=30 DEADLINE=$((DEADLINE - SECONDS)) bash "$(dirname "$0")/ab-decode.sh" > /dev/null
  python3 -c 'import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print("round", r["round"], r["arch"], r["bin"], r["context"],
          "%.3f ms/token, %.3fx the floor" % (r["ms"], r["ms"] / r["floor"]))' "$OUT/ab.jsonl" \
    | tee "$OUT/ab.txt"
  ;;
esac
for f in .device/*.gz; do rm -f "${f%.gz}"; done
