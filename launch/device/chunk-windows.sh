#!/usr/bin/env bash
# Issue 24, a serving pass's chunks attending as one block (each row's window from its chunk's
# first row): the carried GPU tests (the windowed attention against the CPU among them), then
# `serve-ab.sh` with this build ($DIR/canopy) against BASE. DEADLINE and DATASETS pass through.
set -uo pipefail
HERE=$(dirname "$0")
source "$HERE/env.sh"
device_tests
BASE=${BASE:-.device/canopy-base} DEADLINE=${DEADLINE:-230} bash "$HERE/serve-ab.sh"
