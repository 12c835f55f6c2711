# Call 2, the build of 773ab96 (new) against that of e67f281 (base), one H200: generate's
# prefill of 64K on 2 and 4 ranks of the GPU (pieces of 16K and 32K: three later pieces and
# one), tree, two rounds, the binaries in turn.
source launch/device/env.sh; CONTEXTS=64K RANKS=2,4 STRATEGIES=tree ROUNDS=2 DEADLINE=570 OUT=$OUT bash launch/device/decode-split.sh 2>&1 | grep -v "^=="; for f in .device/*.gz; do rm -f "${f%.gz}"; done
