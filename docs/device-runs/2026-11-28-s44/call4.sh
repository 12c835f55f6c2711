# nvidia-h200-x4, build of 6d8a697's code (the set-up's warm-up and barrier) with call 3's DIAG
# events. Validation: bench scaling probes, the peer ring test, model-check's ring fixtures.
source launch/device/env.sh
$BIN compile-kernels > /dev/null 2>&1
probe() { # as call 3's, `pkill -x canopy` on a hang
  local name=$1 ranks=$2; shift 2
  local t0=$SECONDS
  env "$@" RUST_LOG=canopy_cuda=debug CANOPY_PEER_RING=on timeout -k 5 60 $BIN bench scaling \
    --backend cuda --ranks $ranks --strategy ring --heads 32 --kv-heads 8 --head-dim 128 --dtype bf16 \
    --seq-lens 131072 --iters 3 --check-max-tokens 0 --timeout 55 > $OUT/$name.out 2> $OUT/$name.err &
  local pid=$! t=0
  while kill -0 $pid 2>/dev/null && [ $t -lt 20 ]; do sleep 0.5; t=$((SECONDS-t0)); done
  if kill -0 $pid 2>/dev/null; then echo "$name: HUNG at ${t} s"; pkill -9 -x canopy; fi
  wait $pid; echo "$name rc=$? after $((SECONDS-t0)) s: $(grep -E '^ring ' $OUT/$name.out | awk '{print $2, $5}' | tr '\n' ' ')"
}
for i in 1 2 3; do probe p4-$i 4; done
for i in 1 2; do probe p24-$i 2,4; done
PART="test check" CHECK_CASES="f32:2:ring f32:4:ring bf16:4:ring" DEADLINE=$((400 - SECONDS)) bash launch/device/peer-ring.sh
