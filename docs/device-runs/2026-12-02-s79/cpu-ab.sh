# This host (2 cores, no GPU): bench serve on SmolLM2-135M-Instruct (f32, CPU), one random
# 2,048-token prompt at a time, 3 prompts, 4 output tokens; BASE = build of 9921769, NEW =
# build of 514992f (the split prefill, keys and values gathered without a cached context); round 2 runs the binaries in the other order.
B=${BASE:?}; N=${NEW:?}
for round in 1 2; do
for cfg in "1 tree" "2 tree" "2 ring" "4 tree"; do set -- $cfg
for bin in base new; do
  [ $bin = base ] && X=$B || X=$N
  [ $round = 2 ] && { [ $bin = base ] && X=$N || X=$B; bin=$([ $bin = base ] && echo new || echo base); }
  $X bench serve --backend cpu --ranks $1 --strategy $2 --dataset random --input-len 2048 --range-ratio 0 --output-len 4 --num-prompts 3 --max-concurrency 1 --json > r.json 2> r.err
  python3 -c "import json; r=json.load(open('r.json')); print('round $round ranks $1 $2 $bin', 'TTFT mean %.2f s'%(r['ttft_ms']['mean']/1000), 'e2e mean %.2f s'%(r['e2e_latency_ms']['mean']/1000) if 'e2e_latency_ms' in r else '')" 2>/dev/null || tail -2 r.err
done; done; done
