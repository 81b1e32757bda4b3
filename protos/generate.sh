#!/usr/bin/env bash
# Regenerates the Python gRPC code in specd/v1/ from protos/specd/v1/*.proto.
# Run from anywhere: bash protos/generate.sh (needs grpcio-tools: pip install -e '.[test]').
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-$root}"
"${PYTHON:-python}" -m grpc_tools.protoc -I"$root/protos" --python_out="$out" --pyi_out="$out" \
  --grpc_python_out="$out" "$root"/protos/specd/v1/*.proto
