source launch/device/env.sh
nvidia-smi --query-gpu=name --format=csv,noheader | head -2
$BIN compile-kernels > /dev/null 2>&1
for v in "" NCCL_P2P_NVL_CHUNKSIZE=2097152 NCCL_P2P_NVL_CHUNKSIZE=8388608 NCCL_BUFFSIZE=16777216 NCCL_MIN_P2P_NCHANNELS=16 ""; do
  [ $SECONDS -gt 150 ] && { echo "SKIP $v"; continue; }
  env $v $BIN bench scaling --backend cuda --ranks 2 --strategy ring --heads 32 --kv-heads 8 --head-dim 128 \
    --dtype bf16 --seq-lens 131072,1048576 --iters 10 --check-max-tokens 0 --json 2>>$OUT/err.txt \
    | python3 -c 'import json,sys
r=json.load(sys.stdin)
print(sys.argv[1] or "default", [(x["seq_len"], x["ranks"], round(x["median_ms"],3)) for x in r["rows"] if x["ranks"]==2])' "$v"
  echo "[$SECONDS s]"
done
for v in "" NCCL_P2P_NVL_CHUNKSIZE=8388608 NCCL_BUFFSIZE=16777216; do
  [ $SECONDS -gt 200 ] && { echo "SKIP decode $v"; continue; }
  env $v $BIN bench decode --arch llama-3.1-8b --random-weights --context-fill random --context 32K,128K --ranks 2 --strategy ring --decode 10 --json 2>>$OUT/err.txt \
    | python3 -c 'import json,sys
r=json.load(sys.stdin)
print("decode", sys.argv[1] or "default", [(x["context"], round(x["decode_ms_per_token"],2)) for x in r["rows"]])' "$v"
  echo "[$SECONDS s]"
done
