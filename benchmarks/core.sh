#!/usr/bin/env bash
# The core's closing-note numbers: SmolLM2 greedy, 128 new tokens, plain vs prompt lookup,
# on a code-editing prompt and an open question. Usage: bash benchmarks/core.sh [specd args]
set -euo pipefail
cd "$(dirname "$0")"
for prompt in code_edit open_question; do
  for drafter in none prompt-lookup; do
    specd generate "$(cat "prompts/$prompt.txt")" --max-new-tokens 128 --drafter "$drafter" --in-process \
      --json "$@" 2>/dev/null | python3 -c "
import json, sys
r = json.load(sys.stdin)
length = r['acceptance_length']
print(f\"$prompt $drafter: prompt_tokens={r['prompt_tokens']} new_tokens={r['tokens_generated']} \"
      f\"forward_calls={r['forward_calls']} acceptance_length={length:.2f} \"
      f\"tok/s={r['tokens_per_second']:.1f} output_sha={hash(tuple(r['generated_tokens'])) & 0xffffffff:08x}\")"
  done
done
