#!/bin/bash
# The model measured in turn: pre = 028aea9, base = c57f7c5, new = 124acb4 (builds of those commits).
cd /tmp/ab
out=/tmp/s75local/runs
P="Tell me a long story about a lighthouse keeper."
for i in 1 2 3 4 5; do for b in pre base new; do
  ./$b generate --chat --prompt "$P" --max-tokens 200 > $out/one-$b-$i.txt 2>&1
  ./$b generate --chat --prompt "Tell me a story." --max-tokens 64 --n 16 --temperature 0.8 --seed 7 > $out/n16-$b-$i.txt 2>&1
done; done
for i in 1 2 3; do for b in pre base new; do
  ./$b generate --chat --prompt "$P" --max-tokens 200 --ranks 2 > $out/r2-$b-$i.txt 2>&1
done; done
for i in 1 2; do for b in pre base new; do
  ./$b bench serve --backend cpu --dataset random --num-prompts 32 --max-concurrency 16 --input-len 64 --output-len 32 --json > $out/serve-$b-$i.json 2>$out/serve-$b-$i.err
done; done
echo done > $out/DONE
