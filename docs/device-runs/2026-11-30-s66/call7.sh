#!/usr/bin/env bash
# Call 7: `auto` against `q-guided` on the four shared-prefix datasets (128 requests each, all
# at once) on the build of 868ea17.
set -uo pipefail
source launch/device/env.sh
{
  DATASETS="few-shot multi-doc multi-chain system-prompt" METHODS="auto q-guided" OUT=$OUT/ratio \
    bash launch/device/serve-phases.sh > /dev/null
  grep -E "^==|output tokens|decode steps" "$OUT/ratio/serve-phases.txt"
  tar czf "$OUT/ratio.tgz" -C "$OUT" ratio && rm -rf "$OUT/ratio"
} 2>&1 | tee "$OUT/call7.txt"
