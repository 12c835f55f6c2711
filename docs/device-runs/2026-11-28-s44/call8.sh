# Check under mpirun (peers in other processes: slots mapped by IPC handle): on vs off, bit for bit.
source launch/device/env.sh
FIX=tests/fixtures/tiny
mkdir -p $OUT/g
gen() { # gen SWITCH MODEL PROMPT_LEN DTYPE
  local name=$2-p$3-$4-$1
  CANOPY_PEER_RING=$1 timeout -k 2 40 mpirun --allow-run-as-root -np 2 -x NCCL_NVLS_ENABLE -x LD_LIBRARY_PATH \
    -x CANOPY_KERNEL_CACHE -x CANOPY_PEER_RING $BIN generate --backend cuda --model $FIX/$2 --strategy ring \
    --dtype $4 --prompt-ids "$(seq -s, 3 $(($3 + 2)))" --max-tokens 32 --temperature 0 --json --logits \
    > $OUT/g/$name.json 2> $OUT/g/$name.err
  echo "$? $name"
}
for model in gqa-hd64 llama3-hd128 tied-mha-hd64; do for dt in f32 bf16; do
  gen on $model 33 $dt & gen off $model 33 $dt & wait
done; done > $OUT/rc.txt
cat $OUT/rc.txt | tr '\n' ' '; echo
same=0 differ=0
for f in $OUT/g/*-on.json; do
  o=${f%-on.json}-off.json
  if [ -s "$f" ] && cmp -s <(python3 -c 'import json,sys; print(json.dumps(json.load(open(sys.argv[1]))["samples"], sort_keys=True))' "$f") \
       <(python3 -c 'import json,sys; print(json.dumps(json.load(open(sys.argv[1]))["samples"], sort_keys=True))' "$o"); then same=$((same+1)); else differ=$((differ+1)); echo "differs: $f"; tail -3 ${f%.json}.err; fi
done
echo "mpirun -np 2, on vs off: $same the same, $differ differ; ranks $(grep -o '"ranks": [0-9]*' $OUT/g/gqa-hd64-p33-f32-on.json)"
tar czf $OUT/g.tgz -C $OUT g && rm -rf $OUT/g
