#!/usr/bin/env bash
# Session 45, call 7 (one H200), build of c5a4633: the longest context one H200 holds
# (issue 23), decoded at 960K tokens with a random context, tree, beside its floor.
set -uo pipefail
source launch/device/env.sh
mkdir -p $OUT/r
timeout 400 $BIN bench decode --arch llama-3.1-8b --random-weights --context-fill random \
  --context 960K --ranks 1 --strategy tree --decode 10 > $OUT/r/long.txt 2> $OUT/r/long.err
echo "exit $?"; cat $OUT/r/long.txt | grep -v "^\s*$" | head -30
timeout 100 $BIN bench decode --arch llama-3.1-8b --random-weights --context-fill random \
  --context 1100K --ranks 1 --strategy tree --decode 10 > $OUT/r/refused.txt 2>&1
echo "1100K exit $?"; tail -2 $OUT/r/refused.txt
cd $OUT && tar czf all.tgz r && rm -rf r
