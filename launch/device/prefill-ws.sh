#!/usr/bin/env bash
# The warp-specialised prefill attention (issue 23): the GPU tests of the prefill's attention
# (packed and gathered keys) against the CPU for the build's kernel and for each folder of kernel sources in VARIANTS
# (CANOPY_KERNEL_SOURCES), then prefill-ab.sh over the build, the variants and BASE. Results:
# $OUT/tests-*.txt, $OUT/ab.jsonl and $OUT/log.txt.
set -uo pipefail
source "$(dirname "$0")/env.sh"
VARIANTS=${VARIANTS:-}
BASE=${BASE:-.device/canopy-base}
bins="new=$BIN"
for dir in "" $VARIANTS; do
  name=${dir:+$(basename "$dir")}
  name=${name:-new}
  log "GPU tests, $name"
  env ${dir:+CANOPY_KERNEL_SOURCES=$dir} RUST_LOG=canopy_cuda=warn timeout 240 .device/layer_ops --test-threads 1 stored_kv 2>&1 \
    | grep -E "^test |test result|panicked|WARN" | tee "$OUT/tests-$name.txt"
  env ${dir:+CANOPY_KERNEL_SOURCES=$dir} timeout 240 .device/attention_blocks --test-threads 1 2>&1 \
    | grep -E "^test |test result|max error|panicked" | tee -a "$OUT/tests-$name.txt"
  # A kernel that fails or hangs its tests is not timed.
  if [ "$(grep -c "test result: ok" "$OUT/tests-$name.txt")" -lt 2 ]; then
    echo "TESTS FAILED: $name, not timed"
    [ "$name" = new ] && bins=
    continue
  fi
  [ -n "$dir" ] && bins="$bins $name=$BIN+$dir"
done
[ -z "$bins" ] && { echo "no kernel passed its tests: nothing timed"; exit 1; }
BINS="$bins base=$BASE" bash "$(dirname "$0")/prefill-ab.sh"
