# Call 8, the build of 9cdcff3 (the review's mend: a served pass's blocked states allocated
# without a fill), one H200: serve-split.sh with this build alone: the tiny model on 2 ranks of the GPU
# (tree and ring) against the CPU, and a 16K prompt's TTFT served at 2 and 4 ranks (tree).
source launch/device/env.sh; BINS=new=.device/canopy RUNS="2:tree 4:tree" DEADLINE=150 bash launch/device/serve-split.sh 2>&1 | grep -v "^== \[.*round" | head -12; rm -f $OUT/*.err; for f in .device/*.gz; do rm -f "${f%.gz}"; done
