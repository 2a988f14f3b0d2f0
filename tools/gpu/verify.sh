#!/usr/bin/env bash
# One command, run from anywhere on a bare CUDA machine (plain python3 with torch and triton, no
# Bazel, no network), that proves or disproves every GPU claim and writes the results:
#
#   tools/gpu/verify.sh [--out DIR] [--tiny] [--only STEP,...]      (tools/gpu/README.md)
#
# What the machine lacks comes as wheels in .whl/ (tools/gpu/wheels.sh fetches them here):
# they are installed into /tmp/kitchen-site, never into the machine's own Python. The protos'
# Python modules are generated into .gen/ (tools/gen_protos.sh), as outside Bazel anywhere.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PY=${PYTHON:-python3}

if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/kitchen-site .whl/*.whl || { echo "verify: installing .whl/ failed" >&2; exit 1; }
  export PYTHONPATH=/tmp/kitchen-site${PYTHONPATH:+:$PYTHONPATH}
fi
if ! "$PY" -c "import grpc_tools" 2>/dev/null; then
  echo "verify: no grpcio-tools to generate the protos: run tools/gpu/wheels.sh first (.whl/)" >&2
  exit 1
fi
PYTHON="$PY" bash tools/gen_protos.sh >&2 || exit 1
export PYTHONPATH=.:.gen${PYTHONPATH:+:$PYTHONPATH}
exec "$PY" tools/gpu/verify.py "$@"
