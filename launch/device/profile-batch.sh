#!/usr/bin/env bash
# Where a batched decode step's time goes (issue 24's batch-64 pass): `canopy generate` on the
# Llama-3.1-8B shape (random weights), N samples (each of NS) sharing a random CONTEXT-token
# prompt (the few-shot dataset's 4K prefix by default), with graphs and with --eager. Each
# step's phases come from the runtime's `decode step` debug events (books, layout, pass;
# whether it replayed a recorded pass): medians in $OUT/steps.txt. With PROFILE=1, Nsight
# Compute then times every kernel of LAUNCHES launches after SKIP (past the fill, into the
# eager decode steps of N=64): $OUT/kernels.csv.
set -uo pipefail
source "$(dirname "$0")/env.sh"
ARGS=(generate --arch "${ARCH:-llama-3.1-8b}" --random-weights --context-fill random
  --context "${CONTEXT:-4K}")
phases() {
  python3 -c '
import re, sys, statistics as st
rows = [dict(re.findall(r"(\w+)=(\S+)", re.sub(r"\x1b\[[0-9;]*m", "", l)))
        for l in sys.stdin if "decode step" in l]
out = [sys.argv[1]] + ["%s %.3f" % (k, st.median(float(r[k]) for r in rows))
                       for k in ("books_ms", "layout_ms", "pass_ms")]
out.append("replayed %d of %d" % (sum(r["replayed"] == "true" for r in rows), len(rows)))
print("  ".join(out))' "$1"
}
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  for n in ${NS:-1 16 64}; do
    for flag in "" --eager; do
      RUST_LOG=canopy_runtime=debug $BIN "${ARGS[@]}" --n "$n" --max-tokens 40 $flag 2>&1 >/dev/null \
        | phases "n=$n ${flag:-graphs}"
    done
  done
} 2>&1 | tee "$OUT/steps.txt"
if [ "${PROFILE:-0}" = 1 ]; then
  ncu --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum --csv \
    --launch-skip "${SKIP:-1500}" --launch-count "${LAUNCHES:-600}" \
    $BIN "${ARGS[@]}" --n 64 --max-tokens 8 --eager > "$OUT/kernels.csv" 2> "$OUT/ncu-err.txt"
  echo "ncu exit $?; $(wc -l < "$OUT/kernels.csv") lines"
fi
