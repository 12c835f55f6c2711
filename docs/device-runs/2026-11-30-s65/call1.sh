#!/usr/bin/env bash
# Session 65, call 1: the device tests on the build of 94c9481, then cuBLAS's 8B products at
# every decode row count from 16 to 64 (and a few above), canopy's call against cuBLASLt's
# offered algorithms.
source launch/device/env.sh
DEADLINE=560
device_tests
ITERS=40 ROWS=$(seq -s, 16 64),72,80,96,112,128 bash launch/device/lt-bench.sh > /dev/null
tail -3 "$OUT/lt-bench.txt"
