# nvidia-h200-x2, call 4's build. canopy generate on the committed tiny models, ring at 2 ranks
# (threads), the copy engines on, one at a time and four processes at once.
source launch/device/env.sh
$BIN compile-kernels > /dev/null 2>&1
FIX=tests/fixtures/tiny
mkdir -p $OUT/g
gen() { # gen NAME MODEL RANKS PROMPT_LEN
  local name=$1 t0=$SECONDS
  RUST_LOG=canopy_cuda::peer_ring=debug,canopy_cuda::nccl_transport=debug CANOPY_PEER_RING=on \
    timeout -k 2 15 $BIN generate --backend cuda --model $FIX/$2 --ranks $3 --strategy ring --dtype f32 \
    --prompt-ids "$(seq -s, 3 $(($4 + 2)))" --max-tokens 32 --temperature 0 --json \
    > $OUT/g/$name.json 2> $OUT/g/$name.err
  local rc=$?
  echo "$name rc=$rc $((SECONDS - t0)) s hops=$(grep -c 'hop on' $OUT/g/$name.err)"
}
for model in gqa-hd64 llama3-hd128; do
  for r in 2; do for p in 1 7 33 100; do gen $model-r$r-p$p $model $r $p; done; done
done
echo "== four at once"
for p in 1 7 33 100; do gen conc-p$p gqa-hd64 2 $p & done; wait
for p in 1 7 33 100; do gen conc2-p$p llama3-hd128 2 $p & done; wait
tar czf $OUT/g.tgz -C $OUT g && rm -rf $OUT/g
