#!/usr/bin/env bash
# Session 51, call 7 (one H200, for its torch and transformers): tests/fixtures/tiny/kquant-spm/,
# a tiny Llama GGUF in K-quants with the sentencepiece fixture's tokenizer, and transformers'
# logits and greedy tokens from it. The gguf wheel travels in .device/wheels.
set -uo pipefail
pip install -q --no-deps --target /tmp/pylib .device/wheels/gguf-*.whl 2>&1 | grep -v WARNING | tail -2
PYTHONPATH=/tmp/pylib timeout 500 python3 tests/fixtures/make_kquant_llama.py 2>&1 | grep -v -i warn | tail -8
cp tests/fixtures/tiny/kquant-spm/* "$OUT/"
