# This host (2 cores, no GPU): bench serve on SmolLM2-135M-Instruct (f32, CPU), one random
# 2,048-token prompt at a time, 3 prompts, 4 output tokens; BASE = build of 9921769, NEW =
# build of b30ea74 (a ring server's prefill merges as the tree does); round 2 runs the binaries in
# the other order.
B=${BASE:?}; N=${NEW:?}
for round in 1 2; do
for cfg in "2 ring" "2 tree"; do set -- $cfg
order="base new"; [ $round = 2 ] && order="new base"
for bin in $order; do
  [ $bin = base ] && X=$B || X=$N
  $X bench serve --backend cpu --ranks $1 --strategy $2 --dataset random --input-len 2048 --range-ratio 0 --output-len 4 --num-prompts 3 --max-concurrency 1 --json > r.json 2> r.err
  python3 -c "import json; r=json.load(open('r.json')); print('round $round ranks $1 $2 $bin', 'TTFT mean %.2f s'%(r['ttft_ms']['mean']/1000))"
done; done; done
