"""How close each ``--dtype`` computes the model to float32: greedy answers to MT-Bench first
turns in float32, then, per dtype, the share of those answers' tokens whose argmax (teacher
forced: the float32 answer fed back) is the float32 one, the mean first token where its own
greedy answer departs, and the largest log-probability difference on the float32 answer.

    python scripts/dtype_agreement.py                      # SmolLM2: q8 and bfloat16
    python scripts/dtype_agreement.py --dtype q8 --per-category 3 --max-new-tokens 128

The in-process forward only (no service): what each arithmetic computes, not its speed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from coordinator.step.speculative import speculative_decode_with  # noqa: E402
from specd_core.request import SpeculativeOptions  # noqa: E402
from specd_core.sampling import SamplingParams  # noqa: E402
from target_worker import loader  # noqa: E402


def questions(per_category: int) -> list[str]:
    import json

    from specd_tools.bench.serve_data import MT_BENCH_FILE

    picked: dict[str, list[str]] = {}
    for line in MT_BENCH_FILE.read_text().splitlines():
        if line:
            row = json.loads(line)
            got = picked.setdefault(row["category"], [])
            if len(got) < per_category:
                got.append(row["turns"][0])
    return [q for qs in picked.values() for q in qs]


def greedy(decoder, prompt: list[int], n: int, stops: tuple[int, ...]) -> list[int]:
    options = SpeculativeOptions(max_new_tokens=n, sampling=SamplingParams(temperature=0.0),
                                 stop_token_ids=stops)
    return speculative_decode_with(decoder, prompt, decoder.new_cache(), None,
                                   options).generated_tokens


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default SmolLM2)")
    p.add_argument("--dtype", nargs="+", default=["q8", "bfloat16"],
                   choices=["q8", "bfloat16", "float16"])
    p.add_argument("--per-category", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    ref, tokenizer = loader.load_model(args.model, "float32")
    ref.make_batch_invariant((args.threads,))
    stops = tuple(t for t in (tokenizer.eos_token_id,) if t is not None)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                             add_generation_prompt=True, tokenize=True,
                                             return_dict=False)
               for q in questions(args.per_category)]
    answers = [greedy(ref, prompt, args.max_new_tokens, stops) for prompt in prompts]
    print(f"{len(prompts)} MT-Bench first turns, float32 greedy answers of "
          f"{sum(map(len, answers))} tokens")
    print(f"{'dtype':>10}{'top-1 agreement':>18}{'answers identical':>19}"
          f"{'mean first departure':>22}{'max |dlogprob|':>16}")
    for dtype in args.dtype:
        other = loader.load_decoder(args.model, dtype)
        other.make_batch_invariant((args.threads,))
        agree = total = same = 0
        departures, worst = [], 0.0
        for prompt, answer in zip(prompts, answers, strict=True):
            seq = prompt + answer
            rows = slice(len(prompt) - 1, len(seq) - 1)
            a = ref.forward_batch(seq, 0, ref.new_cache())[rows]
            b = other.forward_batch(seq, 0, other.new_cache())[rows]
            agree += int((a.argmax(-1) == b.argmax(-1)).sum())
            total += len(answer)
            idx = torch.tensor(answer)[:, None]
            la = torch.log_softmax(a.double(), -1).gather(1, idx)
            lb = torch.log_softmax(b.double(), -1).gather(1, idx)
            worst = max(worst, float((la - lb).abs().max()))
            own = greedy(other, prompt, args.max_new_tokens, stops)
            pairs = zip(answer, own, strict=False)  # either may stop first
            first = next((i for i, (x, y) in enumerate(pairs) if x != y),
                         None if len(own) == len(answer) else min(len(own), len(answer)))
            same += first is None
            departures.append(len(answer) if first is None else first)
        print(f"{dtype:>10}{agree / total:>17.2%}{same:>12} / {len(prompts):<4}"
              f"{sum(departures) / len(departures):>22.1f}{worst:>16.3g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
