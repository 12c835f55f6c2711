#!/usr/bin/env bash
# Which stage-1 kernel a plan of 2 or 3 query rows a group should run on: `bench tree` with
# --kernel simt (the CUDA-core kernel, the default below 4 rows) and --kernel mma (tensor cores:
# one warp per KV head where the KV heads come in fours, else the many-row CTAs), bf16, one GPU.
#   batch-1 decode (`long`, Q-guided): GQA 3 at 24/8 x 128 (Llama-3.2-3B), 12/4 x 64 and 9/3 x 64
#   (SmolLM2-135M); GQA 2 at 16/8 x 128 and 16/8 x 64; at CONTEXTS (default 8K, 32K, 128K);
#   two and three queries under one prompt at 32/32 x 128 (GQA 1; DeFT-Node, whose root group
#   holds them all), prompts of 8K and 32K.
# Each line: the case, the kernel, and `bench tree`'s median and stage-1 µs (cold L2, ITERS
# timed steps) and relative error; everything else of each run goes to $OUT/runs.txt.
set -uo pipefail
source "$(dirname "$0")/env.sh"
DEADLINE=${DEADLINE:-500}
CONTEXTS=${CONTEXTS:-8192 32768 131072}
ITERS=${ITERS:-20}
# run CASE ARGS...: both kernels, their line each.
run() {
  local name=$1 kernel line
  shift
  for kernel in simt mma; do
    [ "$(left)" -gt 10 ] || { echo "$name $kernel: not run (deadline)"; continue; }
    line=$("$BIN" bench tree "$@" --backend cuda --kernel "$kernel" --iterations "$ITERS" 2>&1 \
      | tee -a "$OUT/runs.txt" | grep -E "^(q-guided|deft-node) ")
    echo "$name $kernel $(awk '{print "median", $(NF-5), "stage1", $(NF-2), "err", $NF}' <<< "$line")"
  done
}
for shape in "24 8 128" "12 4 64" "9 3 64" "16 8 128" "16 8 64"; do
  read -r h kv d <<< "$shape"
  for n in $CONTEXTS; do
    run "$h/$kv x $d, $n" --workload long --seq-len "$n" --batch 1 --method q-guided \
      --heads "$h" --kv-heads "$kv" --head-dim "$d" --dtype bf16
  done
done
for leaves in 2 3; do
  for n in 8192 32768; do
    cat > "/tmp/fan-$leaves-$n.toml" <<T
description = "$leaves queries under one prompt of $n tokens"
[shape]
q_heads = 32
kv_heads = 32
head_dim = 128
dtype = "bf16"
[tree]
kind = "fasttree"
nodes_per_level = [1, $leaves]
tokens_per_level = [$n, 16]
T
    run "32/32 x 128, $leaves queries under $n" --workload "/tmp/fan-$leaves-$n.toml" --method deft-node
  done
done
for f in .device/*.gz; do rm -f "${f%.gz}"; done
