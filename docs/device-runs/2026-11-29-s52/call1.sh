#!/usr/bin/env bash
# Session 52, call 1 (one H200): the session's build checked (the layer-op, attention-block,
# graph and staged weight-upload tests), then the start of `generate` on an 8B-shaped model
# in safetensors (bf16, four shards) and in GGUF (K-quants): the build before the session
# (.device/canopy-old, 4f4b249: every weight read into host memory, then each uploaded by a
# pageable copy) against the session's (each weight read as its upload nears, a thread ahead,
# and copied through page-locked buffers).
set -uo pipefail
source launch/device/env.sh
device_tests
BINS=".device/canopy-old .device/canopy" RUNS=2 bash launch/device/load-times.sh
