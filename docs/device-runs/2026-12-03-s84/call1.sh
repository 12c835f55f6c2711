# model-check.sh's device models on the three seeds of session 83's call 5 and five new ones,
# with model_check.py's revised near-tie rules; every seed's raw outputs kept.
R=$OUT; W=/tmp/seeds; mkdir -p $W
for s in 7 99 2026 11 42 314 8080 31337; do
  OUT=$W/seed-$s SEED=$s STAGES=device DEADLINE=110 bash launch/device/model-check.sh > $W/log-$s.txt 2>&1
  echo "seed $s: $(tail -1 $W/log-$s.txt)" | tee -a $R/summary.txt
done
# Two seeds a file: each file back is limited to 16 MiB.
cd $W && set -- 7 99 2026 11 42 314 8080 31337
while [ $# -gt 0 ]; do tar czf $R/seeds-$1-$2.tgz seed-$1 seed-$2 log-$1.txt log-$2.txt; shift 2; done
ls -la $R
