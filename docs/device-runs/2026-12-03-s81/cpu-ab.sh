# This host (2 cores, no GPU): bench decode on SmolLM2-135M's shape with random weights (f32,
# CPU), a CONTEXT-token prefill (default 4K; one piece unless EXTRA sets a smaller --prefill-chunk),
# RANKS thread ranks (default 1,2), tree; BASE = build of e67f281, NEW = build of 1273eb4; round 2
# runs them in the other order.
B=${BASE:?}; N=${NEW:?}; CONTEXT=${CONTEXT:-4K}; RANKS=${RANKS:-1,2}
for round in 1 2; do
  order="base new"; [ $round = 2 ] && order="new base"
  for name in $order; do
    [ $name = base ] && X=$B || X=$N
    $X bench decode --backend cpu --arch smollm2-135m --random-weights --context $CONTEXT --ranks $RANKS --strategy tree --decode 2 ${EXTRA:-} --json 2>/dev/null | python3 -c 'import json,sys
for x in json.load(sys.stdin)["rows"]: print(sys.argv[1], sys.argv[2], "context", x["context"], "ranks", x["ranks"], "prefill %.2f s" % x["fill_s"])' $round $name
  done
done
