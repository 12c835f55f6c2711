#!/usr/bin/env bash
# Session 65, call 5 (the build of 1f8e6e0): the device tests, then base (94c9481) against new
# on multi-chain all at once (128 requests) and on few-shot at 20 requests a second (192).
source launch/device/env.sh
device_tests
export RUST_LOG=canopy_runtime=debug
RATES="inf" DATASETS=multi-chain PROMPTS=128 TESTS= OUT=$OUT/mc bash launch/device/arrivals-ab.sh > /dev/null
RATES="20" TESTS= BINS="new=.device/canopy base=.device/base" OUT=$OUT/r20 bash launch/device/arrivals-ab.sh > /dev/null
cat "$OUT"/mc/rate-*.txt "$OUT"/r20/rate-*.txt
