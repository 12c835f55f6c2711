#!/usr/bin/env bash
# The ring's decode plans carried over the steps whose tokens land in pages the shards had,
# on every GPU of the machine (G of them; G=2 on one GPU runs two ranks sharing it):
# model-check.sh's fixture cases of the ring (and the tree beside it; 3 ranks share the
# GPUs) against transformers and one rank; then `bench decode` of the Llama-3.1-8B shape
# (random weights and context), tree and ring at 1 and G ranks, the tree rows being the
# control; then a real 32K prefill on one rank, whose row must not count the kernels'
# compilation (the warm-up). Results: $OUT/log.txt, $OUT/runs.tgz.
set -uo pipefail
source "$(dirname "$0")/env.sh"
G=${G:-$(nvidia-smi --list-gpus | wc -l)}
ARCH=(--arch llama-3.1-8b --random-weights)
mkdir -p "$OUT/runs"
{
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
  log "model-check: the fixtures' ring (and tree) on 1 and $G ranks"
  OUT=$OUT/runs/check STAGES=fixtures DEADLINE=${CHECK_DEADLINE:-100} \
    FIXTURE_CASES="f32:1:ring f32:$G:ring bf16:$G:ring bf16:$G:tree f32:3:ring bf16:3:ring" \
    bash "$(dirname "$0")/model-check.sh" > /dev/null 2>&1
  tail -1 "$OUT/runs/check/model-check-log.txt"
  log "bench decode, random context: tree and ring at 1 and $G ranks"
  timeout 200 $BIN bench decode "${ARCH[@]}" --context-fill random --decode 20 \
    --context "${CONTEXTS:-32K,128K,256K}" --ranks "1,$G" --strategy tree,ring \
    --json > "$OUT/runs/decode.json" || log "FAILED or cut off: decode"
  log "bench decode, a real 32K prefill on one rank"
  timeout 100 $BIN bench decode "${ARCH[@]}" --decode 10 --context 32K --ranks 1 \
    --json > "$OUT/runs/prefill.json" || log "FAILED or cut off: prefill"
  python3 - "$OUT/runs/decode.json" "$OUT/runs/prefill.json" <<'PY'
import json, sys
for path in sys.argv[1:]:
    try:
        r = json.load(open(path))
    except Exception as e:
        print(f"{path}: no report: {e}")
        continue
    print(f"{path}: copy {r['copy_bandwidth_gb_s']:.0f} GB/s")
    for x in r["rows"]:
        print(f"{x['context']:>8} {x['ranks']:>2} {x['strategy']:>10} fill {x['fill_s']:7.2f} s  "
              f"total {x['total_s']:7.2f} s  {x['decode_ms_per_token']:8.2f} ms/token  "
              f"{x['vs_floor']:5.2f}x floor")
PY
} 2>&1 | tee "$OUT/log.txt"
tar czf "$OUT/runs.tgz" -C "$OUT" runs && rm -rf "$OUT/runs"
