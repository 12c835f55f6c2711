#!/usr/bin/env bash
# Session 65, call 3: the product-tuning test, then few-shot served all at once and at 40
# requests a second, base (94c9481) against new (products timed at the warm-up: 3 timed runs,
# L2 evicted only before weights under twice its size), two rounds with the order swapped.
source launch/device/env.sh
.device/product_tuning --test-threads 1 2>&1 | grep -E "^test |test result|shapes chosen|panicked" | tee "$OUT/tests.txt"
export RUST_LOG=canopy_runtime=debug,canopy_cuda::layers::tuning=debug
RATES="inf 40" TESTS= OUT=$OUT/r1 bash launch/device/arrivals-ab.sh > /dev/null
RATES="40 inf" TESTS= BINS="new=.device/canopy base=.device/base" OUT=$OUT/r2 bash launch/device/arrivals-ab.sh > /dev/null
cat "$OUT"/r1/rate-*.txt "$OUT"/r2/rate-*.txt
