# Call 2, the build of e67f281 with the device tests (.device/*.gz), one H200, shortened to the
# device time left: the device tests, model-check.sh (1-3 ranks against transformers), then
# sanitizer.sh (its 2-rank prompt of 100 tokens in two pieces among the runs).
source launch/device/env.sh; device_tests > /dev/null 2>&1; grep -E "test result" $OUT/tests.txt; DEADLINE=110 bash launch/device/model-check.sh > $OUT/model-check.txt 2>&1; tail -2 $OUT/model-check.txt; rm -f $OUT/model-check-runs.tgz $OUT/gen-*; timeout 200 bash launch/device/sanitizer.sh > /dev/null 2>&1; grep -E "PASS|FAIL|clean" $OUT/sanitizer.txt; rm -f $OUT/sanitizer-*.txt; for f in .device/*.gz; do rm -f "${f%.gz}"; done
