#!/usr/bin/env bash
# Issue 3 on one H100/H200: CUDA conformance suite, then the decode kernel against the memory
# floor (copy bandwidth measured in the same run), resource report and SASS checks.
#
# Run from the repository root on the device machine, with the release binary carried in
# .device/ (built on the developer machine: cargo build --release; cp target/release/canopy
# .device/; strip .device/canopy). Results go to $OUT (or ./out).
set -uo pipefail
source "$(dirname "$0")/env.sh"
log() { echo "== $*"; }

{
  log "machine"; nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv
  log "canopy info"; $BIN info

  log "selftest (contiguous and paged KV, 1 and 2 ranks on this GPU)"
  time $BIN selftest --backend cuda --ranks 1,2 --cases 3

  log "decode kernel: 16 heads x 128, bf16, 1 query"
  $BIN bench kernel --heads 16 --kv-heads 16 --head-dim 128 --dtype bf16 --json-out "$OUT/kernel_mha.json"
  log "decode kernel: Llama shape 32 q / 8 kv heads"
  $BIN bench kernel --heads 32 --kv-heads 8 --head-dim 128 --dtype bf16 --json-out "$OUT/kernel_llama.json"
  log "decode kernel: batch of 16 requests x 32K, Llama shape"
  $BIN bench kernel --heads 32 --kv-heads 8 --head-dim 128 --dtype bf16 --seq-lens 32768 --batch 16 --json-out "$OUT/kernel_batch.json"

  log "SASS of the decode kernels (16-byte loads, local memory)"
  for f in "$CANOPY_KERNEL_CACHE"/decode-*.cubin; do
    cuobjdump -sass "$f" > /tmp/sass.txt 2>&1 || continue
    printf '%s: LDG.128=%s LDG(all)=%s LDL=%s STL=%s SHFL=%s MUFU.EX2=%s\n' "$(basename "$f")" \
      "$(grep -c 'LDG.E.*128' /tmp/sass.txt)" "$(grep -c 'LDG' /tmp/sass.txt)" \
      "$(grep -c 'LDL' /tmp/sass.txt)" "$(grep -c 'STL' /tmp/sass.txt)" \
      "$(grep -c 'SHFL' /tmp/sass.txt)" "$(grep -c 'MUFU.EX2' /tmp/sass.txt)"
  done
  f=$(ls -S "$CANOPY_KERNEL_CACHE"/decode-*.cubin | head -1)
  cuobjdump -sass "$f" > "$OUT/decode_sass.txt" 2>&1
} 2>&1 | tee "$OUT/log.txt"
