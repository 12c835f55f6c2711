#!/bin/bash
# In turn: base = c57f7c5, mid = 124acb4, final = 917912e (builds of those commits); the
# products' timing program also for pf = 9c711d0.
cd /tmp/ab
out=/tmp/s75final
for round in 1 2 3; do for b in base fact5 pfb final; do
  echo "== $b round $round"; ROWS=1,2,3,4,8,16,32 ./products-$b --ignored --nocapture 2>&1 | grep "^rows"
done; done > $out/products.txt
cp new mid 2>/dev/null
P="Tell me a long story about a lighthouse keeper."
for i in 1 2 3 4 5; do for b in base mid final; do
  ./$b generate --chat --prompt "$P" --max-tokens 200 > $out/runs/one-$b-$i.txt 2>&1
  ./$b generate --chat --prompt "Tell me a story." --max-tokens 64 --n 16 --temperature 0.8 --seed 7 > $out/runs/n16-$b-$i.txt 2>&1
done; done
for i in 1 2 3; do for b in base mid final; do
  ./$b generate --chat --prompt "$P" --max-tokens 200 --ranks 2 > $out/runs/r2-$b-$i.txt 2>&1
done; done
for i in 1 2; do for b in base mid final; do
  ./$b bench serve --backend cpu --dataset random --num-prompts 32 --max-concurrency 16 --input-len 64 --output-len 32 --json > $out/runs/serve-$b-$i.json 2>$out/runs/serve-$b-$i.err
done; done
echo done > $out/DONE
