#!/usr/bin/env bash
# Regenerate the Python stubs from protos/: the control API (elasticd/v1) and the
# part of etcd's gRPC API the store speaks (elasticd/store/etcdpb).
# Usage: scripts/gen_protos.sh [OUT_DIR]   (default: daemon/)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-daemon}"
# The interpreter with grpcio-tools: $PYTHON, else the project venv, else python3.
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
"$PYTHON" -m grpc_tools.protoc -Iprotos --python_out="$out" --pyi_out="$out" \
  --grpc_python_out="$out" protos/elasticd/v1/control.proto \
  protos/elasticd/store/etcdpb/lease.proto protos/elasticd/store/etcdpb/watch.proto
