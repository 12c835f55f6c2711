# This host (2 cores, no GPU): bench decode on SmolLM2-135M's shape with random weights (f32,
# CPU), a 2,048-token prefill, 1, 2 and 4 thread ranks, tree; BASE = build of 9921769, NEW =
# build of 93b3ad6; round 2 runs the binaries in the other order.
B=${BASE:?}; N=${NEW:?}
for round in 1 2; do
  order="base new"; [ $round = 2 ] && order="new base"
  for name in $order; do
    [ $name = base ] && X=$B || X=$N
    $X bench decode --backend cpu --arch smollm2-135m --random-weights --context 2K --ranks 1,2,4 --strategy tree --decode 2 --json 2>/dev/null | python3 -c 'import json,sys
for x in json.load(sys.stdin)["rows"]: print(sys.argv[1], sys.argv[2], "ranks", x["ranks"], "prefill %.2f s" % x["fill_s"])' $round $name
  done
done
