#!/usr/bin/env bash
# Session 51, call 9 (one H200): a GGUF of the Llama-3.1-8B shape (but the 700-piece
# sentencepiece vocabulary of tests/fixtures/spm) whose weights are random K-quant and Q8_0
# blocks, written by make_kquant_llama.py's writer at that shape: the time canopy takes to load
# it (dequantizing to bf16 on the host's 16 cores) and to generate on the GPU, and its decode
# step at 8K beside the floor.
set -uo pipefail
source launch/device/env.sh
pip install -q --no-deps --target /tmp/pylib .device/wheels/gguf-*.whl 2>&1 | grep -v WARNING | tail -2
SECONDS=0
PYTHONPATH=/tmp/pylib python3 - <<'PY'
import pathlib
__file__ = "tests/fixtures/make_kquant_llama.py"
src = open(__file__).read().split("def reference")[0]
src = src.replace("HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 256, 4, 2, 64, 512, 2",
                  "HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 4096, 32, 8, 128, 14336, 32")
exec(src)
write_model(pathlib.Path("/tmp/big.gguf"), 0)
PY
echo "written in ${SECONDS}s: $(stat -c %s /tmp/big.gguf) bytes"
nproc
$BIN compile-kernels > /dev/null 2>&1
for run in 1 2; do
  /usr/bin/time -f "generate: %e s wall, %U s user, %M KB peak" $BIN generate --model /tmp/big.gguf \
    --prompt-ids 5,6,7,8,9,10,11,12 --max-tokens 32 --backend cuda 2>&1 | tail -2
done | tee "$OUT/generate.txt"
$BIN bench decode --model /tmp/big.gguf --context 8K --decode 20 --context-fill random --ranks 1 \
  --strategy tree 2>&1 | tail -6 | tee "$OUT/decode.txt"
