#!/usr/bin/env bash
# Session 65, call 4 (the build of 5f5d799): two ranks on the one GPU served through the
# choice exchange (few-shot, 64 requests, base against new), then `auto` against `q-guided`
# on the four shared-prefix datasets (128 requests each, all at once).
source launch/device/env.sh
for entry in base=.device/base new=.device/canopy; do
  name=${entry%%=*} bin=${entry#*=}
  log "$name: two ranks on one GPU"
  RUST_LOG=canopy_cuda::layers::tuning=debug timeout 200 $bin bench serve --arch llama-3.1-8b \
    --random-weights --backend cuda --max-context 20480 --kv-tokens 131072 --ranks 2 \
    --max-batch 64 --dataset few-shot --num-prompts 64 --max-concurrency 64 --output-len 64 \
    --temperature 0 --json > "$OUT/ranks2-$name.json" 2> "$OUT/ranks2-$name.log"
  echo "rc=$?"; grep -c "timed a product" "$OUT/ranks2-$name.log"; grep -iE "error|panick" "$OUT/ranks2-$name.log" | head -3
  python3 -c "import json; r=json.load(open('$OUT/ranks2-$name.json')); print('$name', r['completed'], 'completed,', round(r['output_throughput']), 'output tokens/s, TPOT median', round(r['tpot_ms']['median'], 2), 'ms')"
done
DATASETS="few-shot multi-doc multi-chain system-prompt" METHODS="auto q-guided" OUT=$OUT/ratio \
  bash launch/device/serve-phases.sh > /dev/null
grep -E "^==|output tokens" "$OUT/ratio/serve-phases.txt"
tar czf "$OUT/ratio.tgz" -C "$OUT" ratio && rm -rf "$OUT/ratio"
