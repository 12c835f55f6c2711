# gemv.cu variants through CANOPY_KERNEL_SOURCES (.device/variants/*/gemv.cu, in call11/variants/):
# each warp asks L2 for the 128-byte lines of its next 1, 2 or 4 rounds of weight blocks before
# the wait and a normed GEMV's staging (pfN), or in the normed GEMVs only (pfNn); base is the
# embedded source. Random weights and context, one rank: Llama-3.1-8B's shape at 8K and 32K,
# three rounds, then Llama-3.2-3B's at 8K, two rounds.
R=$OUT
summary() { python3 -c 'import json,sys,collections
rows=[json.loads(l) for l in open(sys.argv[1])]
by=collections.defaultdict(list)
for r in rows: by[(r["variant"],r["context"])].append(r["ms"])
for (v,c),ms in sorted(by.items()): print(v,c," ".join("%.3f"%m for m in ms))' $1/variants.jsonl; }
OUT=$R/8b ROUNDS=3 CONTEXTS=8K,32K DECODE=30 DEADLINE=190 bash launch/device/kernel-variants.sh > /dev/null
echo "== 8B"; summary $R/8b
OUT=$R/3b ARCH=llama-3.2-3b ROUNDS=2 CONTEXTS=8K DECODE=30 DEADLINE=$((260 - SECONDS)) bash launch/device/kernel-variants.sh > /dev/null
echo "== 3B"; summary $R/3b
cd $R && tar czf results.tgz 8b 3b && rm -rf 8b 3b
