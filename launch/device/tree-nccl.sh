#!/usr/bin/env bash
# Issue 4 on nvidia-h200-x4: Tree Attention across 1, 2 and 4 GPUs of one process (one thread
# and one NCCL communicator per GPU), every merge collective, checked against the f64 oracle;
# plus the CUDA selftest on 4 ranks and a quick decode-kernel check. Same set-up as kernel.sh.
set -uo pipefail
source "$(dirname "$0")/env.sh"
log() { echo "== $*"; }
{
  log "topology"; nvidia-smi topo -m
  log "selftest, 4 ranks on 4 GPUs (host-staged collectives)"
  timeout 200 $BIN selftest --backend cuda --ranks 4 --cases 2 --page-size 0
  log "decode kernel check (GPU 0)"
  timeout 60 $BIN bench kernel --seq-lens 524288,1048576 --check false
  for p in 1 2 4; do
    for n in 131072 1048576 4194304; do
      [ "$p" = 1 ] && [ "$n" != 1048576 ] && continue
      log "tree attention p=$p N=$n, 16 heads x 128, bf16"
      timeout 120 $BIN bench attention --backend cuda --strategy tree --ranks $p --seq-len $n --iters 50 \
        --json > "$OUT/tree_p${p}_n${n}.json" && python3 -c "
import json,sys; d=json.load(open('$OUT/tree_p${p}_n${n}.json'))
for r in d['rows']: print(f\"{r['strategy']:16} p={r['ranks']} N={r['seq_len']:8} median {r['median_ms']:.4f} ms  p10 {r['p10_ms']:.4f}  p90 {r['p90_ms']:.4f}  KV/rank {r['kv_bytes_per_rank']/2**30:.2f} GiB  comm/rank {r['comm_bytes_per_rank']} B  rel err {r['rel_error']:.2e}\")"
    done
  done
} 2>&1 | tee "$OUT/log.txt"
