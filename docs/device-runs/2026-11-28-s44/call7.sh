# nvidia-h200-x2, call 4's build. The ring's output with the copy engines on is the same as
# through NCCL (off), bit for bit: 2 ranks (a GPU each) and 4 (two a GPU), threads.
source launch/device/env.sh
FIX=tests/fixtures/tiny
mkdir -p $OUT/g
gen() { # gen SWITCH MODEL RANKS PROMPT_LEN DTYPE
  local name=$2-r$3-p$4-$5-$1
  CANOPY_PEER_RING=$1 timeout -k 2 20 $BIN generate --backend cuda --model $FIX/$2 --ranks $3 --strategy ring \
    --dtype $5 --prompt-ids "$(seq -s, 3 $(($4 + 2)))" --max-tokens 32 --temperature 0 --json --logits \
    > $OUT/g/$name.json 2> $OUT/g/$name.err
  echo "$? $name"
}
for r in 2 4; do for model in gqa-hd64 llama3-hd128 tied-mha-hd64; do for dt in f32 bf16; do
  for p in 1 33 100; do gen on $model $r $p $dt & gen off $model $r $p $dt & wait; done
done; done; done > $OUT/rc.txt
grep -vc "^0 " $OUT/rc.txt | sed 's/^/failed runs: /'
same=0 differ=0
for f in $OUT/g/*-on.json; do
  o=${f%-on.json}-off.json
  if [ -s "$f" ] && cmp -s <(python3 -c 'import json,sys; print(json.dumps(json.load(open(sys.argv[1]))["samples"], sort_keys=True))' "$f") \
       <(python3 -c 'import json,sys; print(json.dumps(json.load(open(sys.argv[1]))["samples"], sort_keys=True))' "$o"); then same=$((same+1)); else differ=$((differ+1)); echo "differs: $f"; fi
done
echo "on vs off: $same the same, $differ differ"
