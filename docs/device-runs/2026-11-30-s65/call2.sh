#!/usr/bin/env bash
# Session 65, call 2: the device tests (with the product-tuning test) on the working tree's
# build, then few-shot served all at once and at 40 requests a second, base (94c9481) against
# new (products timed at the warm-up), with the timing's debug lines.
source launch/device/env.sh
device_tests
RATES="inf 40" TESTS="" RUST_LOG=canopy_runtime=debug,canopy_cuda::layers::tuning=debug \
  bash launch/device/arrivals-ab.sh
