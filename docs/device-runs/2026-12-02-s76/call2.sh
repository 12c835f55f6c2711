#!/usr/bin/env bash
# Call 2: the CPU's decode attention on the device machine's 16 cores, `base` (50a4173) against
# `new` (ffed2e9) in turn: `bench decode --backend cpu` with random weights and a random
# context, SmolLM2's shape (9/3 heads x 64) and Llama-3.2-1B's (32/8 x 64), three rounds.
set -uo pipefail
source launch/device/env.sh
lscpu | grep -E "Model name|^CPU\(s\)|Flags" | sed 's/\(Flags:.\{0,0\}\).*\(avx512f\).*/\1 ... \2 .../'
for round in 1 2 3; do
  for b in base new; do
    bin=.device/canopy-$b; [ $b = new ] && bin=.device/canopy
    for arch in smollm2-135m llama-3.2-1b; do
      echo "== round $round, $b, $arch"
      timeout 100 $bin bench decode --arch $arch --random-weights --backend cpu --context 4K,32K \
        --context-fill random --decode 20 2>&1 | grep -E "^[0-9]+ "
    done
  done
done
