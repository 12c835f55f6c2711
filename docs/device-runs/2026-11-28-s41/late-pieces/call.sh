source launch/device/env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
mkdir -p $OUT/ab $OUT/step
device_tests > /dev/null 2>&1; grep -E "test result|FAIL|panicked" $OUT/tests.txt
log "selftest mma"
$BIN selftest --backend cuda --kernel mma --ranks 1,2 2>&1 | tail -3 | tee $OUT/selftest.txt
for b in base=.device/canopy-base late=.device/canopy; do
  n=${b%%=*}; bin=${b#*=}
  for s in 32768 131072; do
    CANOPY_KERNEL_CACHE=/tmp/kc-$n $bin bench attention --backend cuda --ranks 1 --seq-len $s --heads 32 --kv-heads 8 --head-dim 128 --dtype bf16 --strategy tree --iters 20 2>&1 | grep -iE "tree|error" | head -3 | sed "s/^/$n $s: /"
  done
done | tee $OUT/attention.txt
log "decode A/B"
for round in 1 2; do
  for cfg in base late pad; do
    [ $SECONDS -gt 420 ] && { echo "SKIP $cfg $round"; continue; }
    case $cfg in base) bin=.device/canopy-base; e=;; late) bin=.device/canopy; e=;; pad) bin=.device/canopy; e=CANOPY_EXP_PAD=1;; esac
    env $e CANOPY_KERNEL_CACHE=/tmp/kc-$cfg $bin bench decode --arch llama-3.1-8b --random-weights --context-fill random --context 8K,32K,128K --ranks 1 --strategy tree --decode 20 --json 2>$OUT/ab/$cfg-$round.err \
     | python3 -c 'import json,sys
r=json.load(sys.stdin)
print(sys.argv[1], sys.argv[2], [(x["context"], round(x["decode_ms_per_token"],3), round(x["decode_ms_per_token"]/x["floor_ms"],3)) for x in r["rows"]])' $cfg $round | tee -a $OUT/ab/ab.txt
  done
done
log "attention in step"
[ $SECONDS -lt 470 ] && OUT=$OUT/step CONTEXTS="32K 128K" bash launch/device/attention-in-step.sh 2>&1 | grep -vE "^\s*$" | tail -30
[ $SECONDS -lt 500 ] && CANOPY_BIN=.device/canopy-base OUT=$OUT/step-base CONTEXTS="32K" bash launch/device/attention-in-step.sh 2>&1 | grep -vE "^\s*$" | tail -12
[ $SECONDS -lt 530 ] && CANOPY_EXP_PAD=1 OUT=$OUT/step-pad CONTEXTS="32K" bash launch/device/attention-in-step.sh 2>&1 | grep -vE "^\s*$" | tail -12
echo "[$SECONDS s]"
