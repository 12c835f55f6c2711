# Call 6, the build of 299854a with the device tests (.device/*.gz), one H200: sampling-check.sh
# (the device tests, the tiny model served on the GPU against generate and against the CPU,
# model-check.sh against transformers, bench serve), shortened, then sanitizer.sh.
source launch/device/env.sh; DEADLINE=300 bash launch/device/sampling-check.sh > /dev/null 2>&1; grep -E "test result|PASS|FAIL|output tokens" $OUT/check.txt | sort | uniq -c; tail -1 $OUT/model-check.txt; rm -rf $OUT/tests $OUT/model-check-runs.tgz $OUT/gen-*; timeout 210 bash launch/device/sanitizer.sh > /dev/null 2>&1; grep -E "PASS|FAIL|clean" $OUT/sanitizer.txt; rm -f $OUT/sanitizer-*.txt; for f in .device/*.gz; do rm -f "${f%.gz}"; done
