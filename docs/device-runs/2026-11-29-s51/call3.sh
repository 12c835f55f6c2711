# Session 51 call 3: the TMA stream with KB boxes along k a stage (KB * 128 bytes of each
# weight row a stage), the weight stream alone and the whole product.
for cfg in "2|3 4" "4|2"; do
  kb=${cfg%|*}; st=${cfg#*|}
  for d in "-DNO_X=1 -DNO_MMA=1" ""; do
    echo "######## KB=$kb $d"
    DEFINES="-DKB=$kb $d" ITERS=50 STAGES="$st" OUT=$OUT/x bash launch/device/gemm-tma-bench.sh 2>&1 \
      | grep -v "^Each\|^NVIDIA H200, 580" | sed 's/   max rel err/  err/'
  done
done
