#!/usr/bin/env bash
# The two builds of ab-attention.sh in turn at longer random contexts (16K and 32K; SmolLM2's
# positions are raised for a random fill), three rounds. Writes runs/long-*.txt here.
set -uo pipefail
cd "$(dirname "$0")"
BINS=${BINS:-/tmp/ab}
M=${MODEL:-$HOME/.cache/canopy/models/SmolLM2-135M-Instruct.Q4_1.gguf}
RUNS=${RUNS:-runs}
mkdir -p $RUNS
for round in 1 2 3; do
  for name in ${NAMES:-base rows}; do
    $BINS/canopy-$name bench decode --model $M --context 16K,32K --context-fill random \
      --decode 20 --backend cpu > $RUNS/long-$name-$round.txt 2>&1
  done
done
