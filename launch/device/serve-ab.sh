#!/usr/bin/env bash
# Issue 24: `serve.sh` with this build ($DIR/canopy, DIR defaults to .device) and again with a
# base build (BASE, a binary), each under its own $OUT/NAME, then both summaries side by
# side. serve.sh's options (DATASETS, CONCURRENCY, PROMPTS, DEADLINE, ...) pass through.
set -uo pipefail
HERE=$(dirname "$0")
ROOT=${OUT:-out}
BASE=${BASE:-.device/canopy-base}
# The carried binaries are unpacked by env.sh, which serve.sh sources only later.
(OUT=$(mktemp -d) && source "$HERE/env.sh")
base_dir=$(mktemp -d)
cp "$BASE" "$base_dir/canopy"
OUT=$ROOT/new bash "$HERE/serve.sh" > /dev/null 2>&1
DIR=$base_dir OUT=$ROOT/base bash "$HERE/serve.sh" > /dev/null 2>&1
for name in new base; do
  echo "== $name"
  sed -n '/summary/,$p' "$ROOT/$name/serve-log.txt"
  grep '^check:' "$ROOT/$name/serve-log.txt"
done | tee "$ROOT/serve-ab.txt"
