#!/usr/bin/env bash
# Session 52, call 2 (one H200): call 1's comparison again, with the session's second build:
# each weight group read into one of a few host buffers that the upload reuses (the source
# writes the stacked q|k|v and gate|up in place), so the host's pages are faulted in once
# instead of once a weight. The staged weight-upload test first.
set -uo pipefail
source launch/device/env.sh
.device/weight_upload 2>&1 | grep -E "^test |test result|panicked" | tee "$OUT/tests.txt"
BINS=".device/canopy-old .device/canopy" RUNS=2 bash launch/device/load-times.sh
