#!/usr/bin/env bash
# EAGLE closing-note numbers: SmolLM2 greedy, 128 new tokens, plain vs prompt lookup vs the
# shipped EAGLE head vs eagle+lookup, interleaved per prompt (the machine is noisy: compare
# ratios within a round). Usage: bash benchmarks/eagle.sh [rounds] [specd args]
set -euo pipefail
cd "$(dirname "$0")"
rounds="${1:-1}"; shift || true
for round in $(seq "$rounds"); do
  for prompt in open_question code_edit; do
    for drafter in none prompt-lookup eagle eagle+lookup; do
      specd generate "$(cat "prompts/$prompt.txt")" --max-new-tokens 128 --drafter "$drafter" \
        --in-process --json "$@" 2>/dev/null | python3 -c "
import json, sys
r = json.load(sys.stdin)
length = r['acceptance_length']
per = ' '.join(f'{x:.2f}' for x in r['accept_rate_per_position'])
print(f\"round=$round $prompt $drafter: new_tokens={r['tokens_generated']} \"
      f\"forward_calls={r['forward_calls']} acceptance_length={length or 0:.2f} \"
      f\"tok/s={r['tokens_per_second']:.1f} per_position=[{per}] \"
      f\"output_sha={hash(tuple(r['generated_tokens'])) & 0xffffffff:08x}\", flush=True)"
    done
  done
done
