#!/usr/bin/env bash
# Fetch the wheels the lent GPU machine lacks (Python 3.12, no network there) into .whl/ (git-ignored).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "gguf==0.19.0"
ls .whl
