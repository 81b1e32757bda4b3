#!/usr/bin/env bash
# The specd rows of issue 16's table, as a user runs them: `specd generate` on the code-edit
# prompt, 160 new tokens, greedy, one process per row (tok/s as the CLI reports it: from the
# request to the last token, prefill included, service start excluded). The transformers rows
# and the paired ratios come from `specd bench --default-path`.
# Usage: bash benchmarks/generate_table.sh [PROMPT_NAME] [extra specd generate args]
set -euo pipefail
cd "$(dirname "$0")"
prompt="${1:-code_edit}"
shift || true
row() {
  local label="$1"; shift
  specd generate "$(cat "prompts/$prompt.txt")" --max-new-tokens 160 --json "$@" 2>/dev/null \
    | python3 -c "
import json, sys
r = json.load(sys.stdin)
print(f\"| $label | {r['tokens_per_second']:.1f} | {r['forward_calls']} | \"
      f\"{hash(tuple(r['generated_tokens'])) & 0xffffffff:08x} |\")"
}
echo "| $prompt: system | tok/s | forward calls | output hash |"
echo "|---|---:|---:|---|"
row "specd generate (default: embedded service, prompt lookup, adaptive)" "$@"
row "specd generate --in-process --drafter prompt-lookup" --in-process --drafter prompt-lookup "$@"
row "specd generate --in-process --drafter none" --in-process --drafter none "$@"
row "specd generate --drafter none (embedded service)" --drafter none "$@"
