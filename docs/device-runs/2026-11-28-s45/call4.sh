#!/usr/bin/env bash
# Session 45, call 4 (one H200): sanitizer.sh on e0667e4's build, and beside it the CUDA
# selftest (--cases 1, ranks 1 and 2) with time to finish and its kernel compiles logged.
set -uo pipefail
source launch/device/env.sh
mkdir -p $OUT/r
( s=$SECONDS; RUST_LOG=canopy_cuda::compile=info timeout 560 $BIN selftest --backend cuda --ranks 1,2 \
    --cases 1 --kernel mma > $OUT/r/selftest.txt 2> $OUT/r/selftest.err
  echo "selftest exit $? after $((SECONDS - s)) s; $(grep -c 'compiled with NVRTC' $OUT/r/selftest.err) kernels compiled" >> $OUT/r/selftest.txt ) &
OUT=$OUT/r bash launch/device/sanitizer.sh > /dev/null 2>&1
wait
tail -3 $OUT/r/sanitizer.txt; cat $OUT/r/selftest.txt
cd $OUT && tar czf all.tgz r && rm -rf r
