# Session 51 call 2: the prototype without its activation copies, without its MMAs, and without
# both (the weight stream alone), 4 and 6 stages.
for d in "-DNO_X=1" "-DNO_MMA=1" "-DNO_X=1 -DNO_MMA=1"; do
  echo "######## $d"
  DEFINES="$d" ITERS=50 STAGES="4 6" OUT=$OUT/x bash launch/device/gemm-tma-bench.sh 2>&1 | grep -v "^Each\|^NVIDIA H200, 580"
done > $OUT/call2.txt 2>&1
