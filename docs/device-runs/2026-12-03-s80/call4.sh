# Call 4, the same binaries as call 3 on the same machine: generate's prefill of 32K (two
# pieces of 16K) on 1 and 2 ranks of the GPU, tree and ring, two rounds, in turn.
source launch/device/env.sh; CONTEXTS=32K ROUNDS=2 DEADLINE=200 OUT=$OUT bash launch/device/decode-split.sh 2>&1 | grep -v "^=="; for f in .device/*.gz; do rm -f "${f%.gz}"; done
