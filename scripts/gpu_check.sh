#!/usr/bin/env bash
# GPU check of the tensor-parallel target (needs S CUDA GPUs on this machine; default S=3, as
# SmolLM2's 9 heads / 3 KV heads allow 1, 3 or 9). Runs TP=1 and TP=S replicas of SmolLM2 on
# Ray (one GPU per rank, NCCL):
#   1. float32 weights: greedy tokens must be identical (exit 1 otherwise);
#   2. bfloat16 weights (the serving dtype): decode tok/s, and how many greedy tokens agree
#      (bf16 sums in another order can flip a near-tie, so this one reports, not asserts).
# Usage: bash scripts/gpu_check.sh [S] [TOKENS]      (PYTHON=... to pick the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
S=${1:-3}
TOKENS=${2:-64}
PY=${PYTHON:-python}
if [ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ]; then PY=.venv/bin/python; fi
"$PY" - "$S" <<'PYEOF'
import sys, torch
need = int(sys.argv[1])
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
print(f"torch {torch.__version__}, CUDA GPUs: {n}")
if n < need:
    sys.exit(f"need {need} GPUs for TP={need}, found {n}")
PYEOF
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
echo "== float32: TP=1 vs TP=$S greedy equality (SmolLM2, $TOKENS tokens)"
"$PY" benchmarks/tp_decode.py --gpu yes --dtype float32 --configs 1:1 "$S":1 \
  --tokens "$TOKENS" --rounds 2 --check-equal
echo "== bfloat16: TP=1 vs TP=$S speed"
"$PY" benchmarks/tp_decode.py --gpu yes --dtype bfloat16 --configs 1:1 "$S":1 \
  --tokens "$TOKENS" --rounds 3
