#!/usr/bin/env bash
# The CPU's decode attention on the build host (2 cores, no GPU), the two builds in turn:
# base = f5dad12, rows = 15af953's tree (a task covers every KV head of a piece of a group's
# tokens; 16 pieces at least). BINS holds canopy-NAME for each; SmolLM2-135M-Instruct (Q4_1
# GGUF) from the model cache; the prompts are session 76's. Writes runs/*.txt here.
set -uo pipefail
cd "$(dirname "$0")"
BINS=${BINS:-/tmp/ab}
M=${MODEL:-$HOME/.cache/canopy/models/SmolLM2-135M-Instruct.Q4_1.gguf}
PROMPTS=../../2026-12-02-s76/local
NAMES=${NAMES:-base rows}
mkdir -p runs
for round in 1 2 3; do
  for name in $NAMES; do
    b=$BINS/canopy-$name
    $b bench decode --model $M --context 512,1K,4K,8K --context-fill random --decode 40 \
      --backend cpu > runs/decode-$name-$round.txt 2>&1
    $b generate --chat --prompt "Write a haiku about the sea." > runs/main-$name-$round.txt 2>&1
    $b generate --prompt "$(cat $PROMPTS/prompt-3600.txt)" --max-tokens 48 > runs/prompt3600-$name-$round.txt 2>&1
  done
done
echo done
