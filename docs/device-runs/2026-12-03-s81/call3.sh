# Call 3, the binaries of call 2: generate's prefill of 127K (130,048) on 4 ranks of the GPU (four
# pieces of up to 32K: three later), tree, two rounds, the binaries in turn.
source launch/device/env.sh; CONTEXTS=130048 RANKS=4 STRATEGIES=tree ROUNDS=2 DEADLINE=570 OUT=$OUT bash launch/device/decode-split.sh 2>&1 | grep -v "^=="; for f in .device/*.gz; do rm -f "${f%.gz}"; done
