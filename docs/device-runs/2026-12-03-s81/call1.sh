# Call 1, the build of 773ab96 with the device tests (.device/*.gz), one H200: the device
# tests (the transport's among them: the scattered merge between ranks on the GPU),
# model-check.sh (1-3 ranks against transformers), then sanitizer.sh.
source launch/device/env.sh; device_tests > /dev/null 2>&1; grep -E "test result|^test .*scatter" $OUT/tests.txt; DEADLINE=150 bash launch/device/model-check.sh > $OUT/model-check.txt 2>&1; tail -2 $OUT/model-check.txt; rm -f $OUT/model-check-runs.tgz $OUT/gen-*; timeout 220 bash launch/device/sanitizer.sh > /dev/null 2>&1; grep -E "PASS|FAIL|clean" $OUT/sanitizer.txt; rm -f $OUT/sanitizer-*.txt; for f in .device/*.gz; do rm -f "${f%.gz}"; done
