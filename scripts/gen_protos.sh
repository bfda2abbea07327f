#!/usr/bin/env bash
# Regenerate the Python stubs for the control API from protos/.
# Usage: scripts/gen_protos.sh [OUT_DIR]   (default: daemon/)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-daemon}"
python -m grpc_tools.protoc -Iprotos --python_out="$out" --pyi_out="$out" \
  --grpc_python_out="$out" protos/elasticd/v1/control.proto
