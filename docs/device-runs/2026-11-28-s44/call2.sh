# nvidia-h200-x4, 0557a20 plus a debug event per hop and per drop of the ring (peer_ring.rs).
# Diagnosis: where the ring's copy-engine hand-off hangs (bench scaling, ranks as threads).
source launch/device/env.sh
$BIN compile-kernels > /dev/null 2>&1
probe() { # probe NAME RANKS ENV...
  local name=$1 ranks=$2; shift 2
  env "$@" RUST_LOG=canopy_cuda::peer_ring=debug CANOPY_PEER_RING=on timeout -k 5 60 $BIN bench scaling \
    --backend cuda --ranks $ranks --strategy ring --heads 32 --kv-heads 8 --head-dim 128 --dtype bf16 \
    --seq-lens 131072 --iters 3 --check-max-tokens 0 --timeout 55 > $OUT/$name.out 2> $OUT/$name.err &
  local pid=$! t=0
  while kill -0 $pid 2>/dev/null && [ $t -lt 30 ]; do sleep 1; t=$((t+1)); done
  if kill -0 $pid 2>/dev/null; then
    echo "$name: still running at ${t} s"
    nvidia-smi --query-gpu=index,utilization.gpu --format=csv,noheader | tr '\n' ' '; echo
    cpid=$(pgrep -f "bench scaling" | head -1)
    gdb -p $cpid -batch -ex "thread apply all bt 20" > $OUT/$name.gdb 2>&1   # no gdb there
    kill -9 $cpid
  fi
  wait $pid; echo "$name rc=$? after $t s"
  echo "hops logged: $(grep -c 'hop on the copy' $OUT/$name.err)"; grep "ring " $OUT/$name.out | head -3
}
probe r4 4
probe r4-conn32 4 CUDA_DEVICE_MAX_CONNECTIONS=32
probe r2 2
probe r4-again 4
