#!/usr/bin/env bash
# Session 45, call 3 (one H200): the device tests, selftest, and bench decode 8K/32K/128K twice
# on e0667e4's build, against session 41's H200 numbers.
set -uo pipefail
source launch/device/env.sh
mkdir -p $OUT/r
OUT=$OUT/r device_tests > /dev/null 2>&1
timeout 200 $BIN selftest --backend cuda --ranks 1,2 --cases 1 --kernel mma > $OUT/r/selftest.txt 2>&1
echo "selftest exit $?" >> $OUT/r/selftest.txt
for round in 1 2; do
  timeout 150 $BIN bench decode --arch llama-3.1-8b --random-weights --context-fill random \
    --context 8K,32K,128K --ranks 1 --strategy tree --decode 20 --json > $OUT/r/decode-$round.json 2> $OUT/r/decode-$round.err
  python3 - $OUT/r/decode-$round.json <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"copy {r['copy_bandwidth_gb_s']:.0f} GB/s")
for x in r["rows"]:
    print(f"{x['context']:>8} {x['decode_ms_per_token']:8.3f} ms/token  floor {x['floor_ms']:.3f}  x{x['vs_floor']:.3f}")
PY
done | tee $OUT/r/decode.txt
grep -E "test result|FAIL|panicked" $OUT/r/tests.txt; tail -3 $OUT/r/selftest.txt
cd $OUT && tar czf all.tgz r && rm -rf r
