# Call 4, the build of 7c93da9 (new; with the served pass's reduce-scatter) against that of
# e67f281 (base), one H200: the attention-block tests (gather_states among them), then
# serve-split.sh: the tiny model on 2 ranks of the GPU against the CPU, and a
# 16K prompt's TTFT served at 1, 2 and 4 ranks of the GPU (tree) and at 2 (ring).
source launch/device/env.sh; device_test attention_blocks "" --test-threads 1 | grep -E "result|gathered"; RUNS="1:tree 2:tree 4:tree 2:ring" DEADLINE=500 bash launch/device/serve-split.sh 2>&1 | grep -v "^== \[.*round"; rm -rf $OUT/tests; for f in .device/*.gz; do rm -f "${f%.gz}"; done
