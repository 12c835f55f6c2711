# Call 3, the builds of e67f281 (new) and 30fc6e0 (base), one H200: generate's prefill of 16K
# (one piece) on 1 and 2 ranks of the GPU, tree and ring, two rounds, in turn.
source launch/device/env.sh; CONTEXTS=16K ROUNDS=2 DEADLINE=230 OUT=$OUT bash launch/device/decode-split.sh 2>&1 | grep -v "^=="; for f in .device/*.gz; do rm -f "${f%.gz}"; done
