#!/usr/bin/env bash
# Generates the protos' Python modules and their type stubs (.pyi) into .gen/ for running code
# outside Bazel (the GPU machine, a quick pytest): PYTHONPATH=.:.gen python3 ...; mypy finds the
# stubs there through mypy.ini's mypy_path.
# Inside Bazel the same modules come from //protos (tools/proto.bzl); this is not used there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WKT=$("$PY" -c 'import grpc_tools, os; print(os.path.join(os.path.dirname(grpc_tools.__file__), "_proto"))')
mkdir -p .gen
"$PY" -m grpc_tools.protoc -I. -I"$WKT" --python_out=.gen --pyi_out=.gen --grpc_python_out=.gen protos/*.proto
echo "generated $(ls .gen/protos | wc -l) modules in .gen/protos"
