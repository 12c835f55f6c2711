#!/usr/bin/env bash
# Session 45, call 5 (one H200), build of a60c803: 8 ranks on one GPU standing in for the 8-GPU
# node (issue 27): the tiny fixtures at 8 ranks against transformers and one rank, and bench
# decode at 1 and 8 ranks, tree and ring; then the note of mpirun -np 2 on one GPU.
set -uo pipefail
source launch/device/env.sh
mkdir -p $OUT/r
STAGES=fixtures FIXTURE_CASES="f32:1:tree f32:8:tree f32:8:ring bf16:1:tree bf16:8:tree bf16:8:ring" \
  DEADLINE=230 FIXTURE_LIMIT=220 OUT=$OUT/r bash launch/device/model-check.sh > /dev/null 2>&1
grep -E "fixtures done|^f32|^bf16|ALL PASS|FAILURES|counted" $OUT/r/model-check-log.txt
timeout 250 $BIN bench decode --arch llama-3.1-8b --random-weights --context-fill random \
  --context 32K,128K --ranks 1,8 --strategy tree,ring --decode 10 --json > $OUT/r/decode-8.json 2> $OUT/r/decode-8.err
echo "decode exit $?"
python3 - $OUT/r/decode-8.json <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"copy {r['copy_bandwidth_gb_s']:.0f} GB/s")
for x in r["rows"]:
    m = x.get("merge_ms_per_layer")
    print(f"{x['context']:>8} P={x['ranks']} {x['strategy']:<18} {x['decode_ms_per_token']:8.3f} ms/token floor {x['floor_ms']:.3f} "
          f"x{x['vs_floor']:.3f} merge {'-' if m is None else f'{m*1e3:.1f} us/layer'} peak {(x.get('peak_bytes') or 0)/2**30:.1f} GiB")
PY
timeout 60 mpirun --allow-run-as-root -np 2 -x LD_LIBRARY_PATH -x NCCL_NVLS_ENABLE -x CANOPY_KERNEL_CACHE \
  $BIN generate --backend cuda --model tests/fixtures/tiny/gqa-hd64 --prompt-ids 3,4,5,6 --max-tokens 4 \
  --temperature 0 --json > $OUT/r/mpi2.json 2> $OUT/r/mpi2.err
echo "mpirun -np 2 exit $?"; grep -m2 "note" $OUT/r/mpi2.err
cd $OUT && tar czf all.tgz r && rm -rf r
