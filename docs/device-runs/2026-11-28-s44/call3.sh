# nvidia-h200-x4, call 2's build plus "DIAG" debug events after the push, after the landing and
# in finish_kv_exchange (not committed). Lazy against eager module loading; ranks 4 alone and 2,4.
source launch/device/env.sh
$BIN compile-kernels > /dev/null 2>&1
probe() { # probe NAME RANKS ENV...
  local name=$1 ranks=$2; shift 2
  local t0=$SECONDS
  env "$@" RUST_LOG=canopy_cuda=debug CANOPY_PEER_RING=on timeout -k 5 60 $BIN bench scaling \
    --backend cuda --ranks $ranks --strategy ring --heads 32 --kv-heads 8 --head-dim 128 --dtype bf16 \
    --seq-lens 131072 --iters 3 --check-max-tokens 0 --timeout 55 > $OUT/$name.out 2> $OUT/$name.err &
  local pid=$! t=0
  while kill -0 $pid 2>/dev/null && [ $t -lt 20 ]; do sleep 0.5; t=$((SECONDS-t0)); done
  if kill -0 $pid 2>/dev/null; then
    echo "$name: HUNG at ${t} s"
    cpid=$(pgrep -f "bench scaling" | head -1)
    for task in /proc/$cpid/task/*; do echo "$(cat $task/comm) $(cat $task/wchan) $(cut -d' ' -f1 $task/syscall)"; done | sort | uniq -c | sort -rn | head -12
    kill -9 $cpid
  fi
  wait $pid; echo "$name rc=$? after $((SECONDS-t0)) s: $(grep -E '^ring ' $OUT/$name.out | awk '{print $5}')"
}
for i in 1 2 3; do probe lazy-$i 4; done
for i in 1 2 3; do probe eager-$i 4 CUDA_MODULE_LOADING=EAGER; done
probe lazy-24 2,4
probe eager-24 2,4 CUDA_MODULE_LOADING=EAGER
