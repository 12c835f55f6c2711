#!/usr/bin/env bash
# Issue 23, the decode GEMVs that RMS-normalise their activation themselves (one launch instead
# of rms_norm then the GEMV, at up to NORMED_GEMV_ROWS rows): the carried GPU tests (the fused
# ops against the two ops, bit for bit), each kernel's time in a step (`kernel-times.sh`), then
# `ab-decode.sh` of this build against BASE, 8B shape. CONTEXTS, ROUNDS and DECODE pass through.
set -uo pipefail
HERE=$(dirname "$0")
source "$HERE/env.sh"
device_tests
BINS="new=$BIN base=${BASE:-.device/canopy-base}" bash "$HERE/kernel-times.sh" > /dev/null
BINS="new=$BIN base=${BASE:-.device/canopy-base}" ARCHS=${ARCHS:-llama-3.1-8b} CONTEXTS=${CONTEXTS:-8K,32K} \
  ROUNDS=${ROUNDS:-2} DECODE=${DECODE:-30} bash "$HERE/ab-decode.sh"
