#!/usr/bin/env bash
# Issue 23: compute-sanitizer on short generations with the committed tiny models (no host
# round trips hidden from it: every kernel of prefill and decode, the GEMVs, the programmatic
# dependent launches, the tree and ring merges of ranks sharing the GPU). Each run is
# `canopy generate --backend cuda` of 8 tokens under each TOOLS entry (default memcheck, then
# racecheck and initcheck on one rank); a run passes when the sanitizer reports no error. One
# memcheck run prompts 16 tokens, more than the GEMV takes, so the prefill's products run on
# cuBLAS and read the rounded operands their producers write. (initcheck on that run reports
# `swiglu`'s reads of cuBLAS's output as uninitialized, on the session-22 build as well:
# BENCHMARKS, session 23.) One memcheck run decodes two samples of 48 tokens (TOKENS), past
# the 32 tokens of growth room: its replans rewrite the recorded step's plan in place, and
# its replays read the rewritten plan. Two memcheck runs prompt 100 tokens, whose products run
# at 128 rows (the padding rows of `product_rows`), and one of them again on 2 ranks in two
# pieces. Random-weight model shapes (ARCHS) run last: under memcheck, and under racecheck,
# where a run passes when no hazard lies in canopy's own kernels (at these shapes racecheck
# reports hazards inside cuBLAS's GEMM kernels, which are listed).
# Results: $OUT/sanitizer-*.txt and the summary in $OUT/sanitizer.txt.
set -uo pipefail
source "$(dirname "$0")/env.sh"
SAN=${SAN:-/usr/local/cuda-13.0/bin/compute-sanitizer}
FIX=tests/fixtures/tiny
runs=0 bad=0
# own_hazards REPORT: racecheck's hazards in REPORT counted by kernel; fails when any lies in
# one of canopy's kernels (the extern "C" kernels of crates/canopy-kernels/cuda) or the run did
# not end.
own_hazards() {
  python3 - "$1" crates/canopy-kernels/cuda/*.cu* <<'PY'
import collections, re, sys
report = open(sys.argv[1], errors="replace").read()
bounds = r"__launch_bounds__\((?:[^()]|\([^()]*\))*\)"
ours = set()
for source in sys.argv[2:]:
    ours |= set(re.findall(r'extern "C"\s+__global__\s+void\s+(?:' + bounds + r"\s+)?(\w+)\s*\(",
                           open(source).read()))
by_kernel = collections.Counter(re.findall(r"access at (\w+)\+", report))
for name, accesses in by_kernel.most_common():
    print(f"   {accesses} racing accesses in {name}" + (" (canopy's)" if name in ours else ""))
ended = "RACECHECK SUMMARY" in report and "Target application returned an error" not in report
sys.exit(0 if ended and not ours & set(by_kernel) else 9)
PY
}
# check NAME TOOL ARGS...: one `generate` under the sanitizer. With OWN_KERNELS set (racecheck
# only), every hazard is listed and the run passes when none lies in canopy's kernels.
check() {
  local name=$1 tool=$2 limit=20
  shift 2
  [ -n "${OWN_KERNELS:-}" ] && limit=0
  "$SAN" --tool "$tool" --error-exitcode 9 --print-limit $limit \
    "$BIN" generate --backend cuda --prompt-ids "${PROMPT_IDS:-1,5,9,13,2,7,11}" \
    --max-tokens "${TOKENS:-8}" --temperature 0 "$@" > "$OUT/sanitizer-$name.txt" 2>&1
  local rc=$?
  [ -n "${OWN_KERNELS:-}" ] && { own_hazards "$OUT/sanitizer-$name.txt"; rc=$?; }
  runs=$((runs + 1))
  if [ $rc -eq 0 ]; then echo "PASS $name ($tool)"; else bad=$((bad + 1)); echo "FAIL $name ($tool, exit $rc)"; tail -15 "$OUT/sanitizer-$name.txt"; fi
}
{
  "$SAN" --version | head -2
  TOKENS=48 check llama3-hd128-bf16-r1-replan memcheck --model "$FIX/llama3-hd128" --dtype bf16 --n 2 --json
  for model in gqa-hd64 llama3-hd128 tied-mha-hd64; do
    check "$model-bf16-r1" memcheck --model "$FIX/$model" --dtype bf16
  done
  check gqa-hd64-f32-r1 memcheck --model "$FIX/gqa-hd64" --dtype f32
  check gqa-hd64-bf16-r2-tree memcheck --model "$FIX/gqa-hd64" --dtype bf16 --ranks 2 --strategy tree
  check gqa-hd64-bf16-r2-ring memcheck --model "$FIX/gqa-hd64" --dtype bf16 --ranks 2 --strategy ring
  for tool in ${TOOLS:-racecheck initcheck}; do
    check "llama3-hd128-bf16-r1-$tool" "$tool" --model "$FIX/llama3-hd128" --dtype bf16
  done
  PROMPT_IDS=1,5,9,13,2,7,11,3,17,4,23,6,19,8,29,10 \
    check llama3-hd128-bf16-r1-prompt16 memcheck --model "$FIX/llama3-hd128" --dtype bf16
  # 100 prompt rows: the products run at 128, their padding rows in every activation.
  long=$(seq -s, 3 3 300)
  for dtype in bf16 f32; do
    PROMPT_IDS=$long check "gqa-hd64-$dtype-r1-prompt100" memcheck --model "$FIX/gqa-hd64" --dtype $dtype
  done
  # The same on 2 ranks in pieces of 64: the first piece's keys and values gathered, the
  # second's queries.
  PROMPT_IDS=$long check gqa-hd64-bf16-r2-prompt100-pieces memcheck --model "$FIX/gqa-hd64" \
    --dtype bf16 --ranks 2 --prefill-chunk 32
  # Random-weight shapes of ARCHS (default Llama-3.2-3B's: GQA 3, KV heads in eights), whose
  # decode groups of three query rows take the tensor cores, which no fixture's heads reach:
  # memcheck for 4 tokens on 1 rank and on 2 ranks, racecheck for 2 on one.
  for arch in ${ARCHS:-llama-3.2-3b}; do
    for ranks in 1 2; do
      TOKENS=4 check "$arch-bf16-r$ranks" memcheck --arch "$arch" --random-weights --dtype bf16 --ranks $ranks
    done
    # racecheck flags cuBLAS's own GEMM kernels at these shapes (listed, not held against the
    # run). At Llama-3.1-8B's shape racecheck's process outgrows the device machine's host memory
    # (125 GiB) and is killed.
    OWN_KERNELS=1 TOKENS=2 check "$arch-bf16-r1-racecheck" racecheck --arch "$arch" --random-weights --dtype bf16
  done
  echo "$((runs - bad))/$runs runs clean"
} 2>&1 | tee "$OUT/sanitizer.txt"
