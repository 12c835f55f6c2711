#!/usr/bin/env bash
# Issue 4 on nvidia-h200-x4: the ring baseline over NCCL (KV shards passed with grouped
# send/recv on a second stream, overlapped with the partial kernel), at p = 2 and 4, beside
# tree attention at p = 4, N = 1M from the same run; every point checked against the f64
# oracle, with the link bandwidth measured alone for the ring's floor. Same set-up as kernel.sh.
set -uo pipefail
source "$(dirname "$0")/env.sh"
log() { echo "== $*"; }
{
  for p in 2 4; do
    for n in 131072 1048576 4194304; do
      strategy=ring
      [ "$p" = 4 ] && [ "$n" = 1048576 ] && strategy=all
      log "$strategy p=$p N=$n, 16 heads x 128, bf16"
      timeout 150 $BIN bench attention --backend cuda --strategy $strategy --ranks $p --seq-len $n --iters 20 \
        --json > "$OUT/${strategy}_p${p}_n${n}.json" && python3 -c "
import json; d=json.load(open('$OUT/${strategy}_p${p}_n${n}.json'))
for r in d['rows']:
    link = r['link_gbps']; floor = r['comm_bytes_per_rank'] / (link * 1e9) * 1e3 if link else float('nan')
    print(f\"{r['strategy']:16} p={r['ranks']} N={r['seq_len']:8} median {r['median_ms']:.4f} ms  p10 {r['p10_ms']:.4f}  p90 {r['p90_ms']:.4f}  comm/rank {r['comm_bytes_per_rank']/2**30:.3f} GiB  link {link or 0:.0f} GB/s  ring floor {floor:.3f} ms  rel err {r['rel_error']:.2e}\")"
    done
  done
} 2>&1 | tee "$OUT/log.txt"
