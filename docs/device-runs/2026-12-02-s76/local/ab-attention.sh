#!/usr/bin/env bash
# The CPU's attention, the session's builds in turn on the build host (2 cores, no GPU):
# base = 50a4173, exp = c58298a (rten-vecmath's exponentials, fused 8-wide loops), l2 =
# 4e9e3a2 (the next block asked into L2), final = ffed2e9 (AVX2 scores, eight keys at a time).
# BINS holds canopy-NAME for each; SmolLM2-135M-Instruct (Q4_1 GGUF) from the model cache.
# Writes runs/*.txt here.
set -uo pipefail
cd "$(dirname "$0")"
BINS=${BINS:-/tmp/ab}
M=${MODEL:-$HOME/.cache/canopy/models/SmolLM2-135M-Instruct.Q4_1.gguf}
NAMES=${NAMES:-base exp l2 final}
mkdir -p runs
for round in 1 2 3; do
  for name in $NAMES; do
    b=$BINS/canopy-$name
    $b bench decode --model $M --context 512,1K,4K,8K --context-fill random --decode 40 \
      --backend cpu > runs/decode-$name-$round.txt 2>&1
    $b generate --chat --prompt "Write a haiku about the sea." > runs/main-$name-$round.txt 2>&1
    $b generate --chat --prompt "Write a haiku about the sea." --n 16 --temperature 0.8 \
      --max-tokens 64 > runs/n16-$name-$round.txt 2>&1
    [ $round -le 2 ] && for len in 900 3600; do
      $b generate --prompt "$(cat prompt-$len.txt)" --max-tokens 48 > runs/prompt$len-$name-$round.txt 2>&1
    done
  done
done
echo done
