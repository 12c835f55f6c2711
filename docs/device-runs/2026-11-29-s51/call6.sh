#!/usr/bin/env bash
# Session 51, call 6 (one H200, for its transformers): tests/fixtures/spm/reference.json, the
# token ids transformers' GGUF tokenizer gives for the sentencepiece fixture's texts. The gguf
# and sentencepiece wheels travel in .device/wheels.
set -uo pipefail
pip install -q --no-deps --target /tmp/pylib .device/wheels/*.whl 2>&1 | tail -2
PYTHONPATH=/tmp/pylib python3 tests/fixtures/make_spm_gguf.py reference 2>&1 | grep -v Warning | tail -5
cp tests/fixtures/spm/reference.json "$OUT/"
