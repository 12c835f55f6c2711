#!/usr/bin/env bash
# How long `canopy generate` takes to start on a model of the Llama-3.1-8B shape, and how much
# host memory it holds, from two files written here with random weights:
#   safetensors  a Hugging Face directory in four bf16 shards (16.06 GB), with the tiny
#                llama3-hd128 fixture's tokenizer;
#   f16          the same in f16 (as many older checkpoints are), which a bf16 run converts;
#   gguf         the K-quant and Q8_0 mix of tests/fixtures/make_kquant_llama.py at the 8B
#                shape (about 4 GB), with the fixture's sentencepiece vocabulary (needs the
#                gguf wheel in .device/wheels).
# Each binary of BINS (default: .device/canopy) runs `generate` RUNS times on each file
# (8 prompt tokens, 16 new, on the GPU), timed by /usr/bin/time; RUST_LOG=info prints each
# upload's own account where the binary has one. COLD=1 first drops each file from the page
# cache (posix_fadvise DONTNEED, after an fsync), so a run reads it from the disk; `fincore`
# then says how much of it stayed cached. Results: $OUT/load-times.txt.
set -uo pipefail
source "$(dirname "$0")/env.sh"
BINS=${BINS:-$BIN}
RUNS=${RUNS:-2}
FILES=${FILES:-safetensors gguf}
WORK=${WORK:-/tmp/canopy-load}
mkdir -p "$WORK"
has() { [[ " $FILES " == *" $1 "* ]]; }

for file in safetensors f16; do
  dir=$WORK/hf dtype=bfloat16
  [ "$file" = f16 ] && dir=$WORK/hf16 dtype=float16
  has "$file" && [ ! -f "$dir/config.json" ] || continue
  log "writing the $file model"
  python3 - "$dir" "$dtype" <<'PY'
import json, os, shutil, sys
import torch
from safetensors.torch import save_file
out, dtype = sys.argv[1], sys.argv[2]
os.makedirs(out, exist_ok=True)
fixture = "tests/fixtures/tiny/llama3-hd128"
config = json.load(open(f"{fixture}/config.json"))
config.update(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
              num_attention_heads=32, num_key_value_heads=8, head_dim=128,
              vocab_size=128256, tie_word_embeddings=False, torch_dtype=dtype)
json.dump(config, open(f"{out}/config.json", "w"), indent=1)
for f in ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]:
    shutil.copy(f"{fixture}/{f}", out)
H, F, Q, KV, V, L = 4096, 14336, 4096, 1024, 128256, 32
shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H)}
for l in range(L):
    p = f"model.layers.{l}."
    shapes.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                   p + "self_attn.q_proj.weight": (Q, H), p + "self_attn.k_proj.weight": (KV, H),
                   p + "self_attn.v_proj.weight": (KV, H), p + "self_attn.o_proj.weight": (H, Q),
                   p + "mlp.gate_proj.weight": (F, H), p + "mlp.up_proj.weight": (F, H),
                   p + "mlp.down_proj.weight": (H, F)})
names = list(shapes)
shards = [names[i::4] for i in range(4)]
weight_map = {}
g = torch.Generator(device="cuda").manual_seed(0)
for i, part in enumerate(shards):
    file = f"model-{i + 1:05d}-of-00004.safetensors"
    tensors = {n: (torch.randn(shapes[n], generator=g, device="cuda") * 0.02).to(getattr(torch, dtype)).cpu()
               for n in part}
    save_file(tensors, f"{out}/{file}", metadata={"format": "pt"})
    weight_map.update({n: file for n in part})
json.dump({"metadata": {}, "weight_map": weight_map}, open(f"{out}/model.safetensors.index.json", "w"))
PY
  du -sh "$dir"
done

if has gguf && [ ! -f "$WORK/big.gguf" ]; then
  log "writing the GGUF model"
  pip install -q --no-deps --target /tmp/pylib .device/wheels/gguf-*.whl 2>&1 | grep -v WARNING | tail -2
  PYTHONPATH=/tmp/pylib python3 - "$WORK/big.gguf" <<'PY'
import pathlib, sys
__file__ = "tests/fixtures/make_kquant_llama.py"
src = open(__file__).read().split("def reference")[0]
src = src.replace("HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 256, 4, 2, 64, 512, 2",
                  "HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 4096, 32, 8, 128, 14336, 32")
exec(src)
write_model(pathlib.Path(sys.argv[1]), 0)
PY
  ls -la "$WORK/big.gguf"
fi

log "host: $(nproc) cores, $(free -g | awk '/Mem/ {print $2}') GB"
for bin in $BINS; do
  "$bin" compile-kernels > /dev/null 2>&1
  for file in $FILES; do
    model=$WORK/hf
    [ "$file" = gguf ] && model=$WORK/big.gguf
    [ "$file" = f16 ] && model=$WORK/hf16
    for run in $(seq "$RUNS"); do
      if [ "${COLD:-0}" = 1 ]; then
        find "$model" -type f -size +1M -exec python3 -c 'import os, sys
for path in sys.argv[1:]:
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)' {} +
        fincore -b "$model" "$model"/* 2>/dev/null | awk 'NR > 1 {cached += $1} END {print "cached after the drop: " cached + 0 " bytes"}'
      fi
      log "$bin $file run $run${COLD:+ (cold: $COLD)}"
      RUST_LOG=canopy_runtime=info /usr/bin/time -f "time: %e s wall, %U s user, %S s sys, %M KB peak" \
        "$bin" generate --model "$model" --prompt-ids 5,6,7,8,9,10,11,12 --max-tokens 16 \
        --backend cuda 2>&1 >/dev/null | grep -E 'uploaded|first token|time:|rror|panicked|already'
    done
  done
done 2>&1 | tee "$OUT/load-times.txt"
