"""What log probabilities cost the target (README, "The OpenAI-compatible HTTP API"): a
verify step's time and output bytes with and without ``logprobs``, and a prompt's prefill with
and without ``prompt_logprobs``, on one `TargetEngine` (no service, no transport). Besides the
whole step it prints the engine's own split: the forward (``forward_seconds``: where a scored
prompt's LM head over every row lands) and the rows work after it (``rows_seconds``: the
sampling rows, and the log-softmax and top-k of a request asking for log probabilities).

    python benchmarks/logprobs_cost.py                      # the default model (SmolLM2)
    python benchmarks/logprobs_cost.py --model tiny-random --rounds 5

Each case is timed ``--rounds`` times, cases interleaved, medians printed. Needs a quiet
machine: every figure is a wall time.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

PROMPT = Path(__file__).resolve().parent / "prompts" / "code_edit.txt"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a load_model source (default: SmolLM2)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--draft", type=int, default=5, help="draft tokens per verify block")
    parser.add_argument("--k", type=int, default=5, help="top alternatives asked for")
    args = parser.parse_args()

    import torch

    from specd_core.sampling import SamplingParams
    from specd_core.step import PrefillItem, VerifyItem, payload_bytes
    from specd_core.text import encode_prompt
    from target_worker.engine import TargetEngine
    from target_worker.loader import load_model

    torch.set_num_threads(args.threads)
    decoder, tokenizer = load_model() if args.model is None else load_model(args.model)
    vocab = decoder.config.vocab_size
    prompt = [t % vocab for t in encode_prompt(tokenizer, PROMPT.read_text(), raw=False)]
    engine = TargetEngine(decoder, max_slots=1, prefix_cache_tokens=0)
    slot = engine.allocate()
    greedy, dense = SamplingParams(), SamplingParams(temperature=0.8)
    sparse = SamplingParams(temperature=0.8, top_p=0.9)
    block = prompt[-(args.draft + 1):]  # a verify block fed again and again at one position
    start = len(prompt)

    def prefill(k: int | None):
        return engine.step([PrefillItem(slot, prompt, greedy, prompt_logprobs=k,
                                        logprobs=k)])

    def verify(sampling, k: int | None):
        return engine.step([VerifyItem(slot, start, block, sampling, logprobs=k)])

    cases = {
        "prefill": lambda: prefill(None),
        f"prefill, prompt_logprobs={args.k}": lambda: prefill(args.k),
        "verify greedy": lambda: verify(greedy, None),
        f"verify greedy, logprobs={args.k}": lambda: verify(greedy, args.k),
        "verify top_p 0.9": lambda: verify(sparse, None),
        f"verify top_p 0.9, logprobs={args.k}": lambda: verify(sparse, args.k),
        "verify dense T=0.8": lambda: verify(dense, None),
        f"verify dense T=0.8, logprobs={args.k}": lambda: verify(dense, args.k),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    forward: dict[str, list[float]] = {name: [] for name in cases}
    rows: dict[str, list[float]] = {name: [] for name in cases}
    sizes: dict[str, int] = {}
    stats = engine.stats
    prefill(None)  # the cache then holds the prompt every verify case continues
    for name, fn in cases.items():  # warm-up
        if name.startswith("verify"):
            fn()
    for _ in range(args.rounds):
        for name, fn in cases.items():
            f0, r0 = stats["forward_seconds"], stats["rows_seconds"]
            t0 = time.perf_counter()
            out = fn()
            times[name].append(time.perf_counter() - t0)
            forward[name].append(stats["forward_seconds"] - f0)
            rows[name].append(stats["rows_seconds"] - r0)
            sizes[name] = payload_bytes(out)
    print(f"model {args.model or 'SmolLM2-135M-Instruct'} (vocab {vocab}), prompt "
          f"{len(prompt)} tokens, verify blocks of {len(block)} rows, {args.threads} thread(s), "
          f"median of {args.rounds}")
    print(f"{'case':40} {'step ms':>9} {'forward ms':>11} {'rows ms':>8} {'output bytes':>13}")
    for name in cases:
        ms = [statistics.median(x[name]) * 1e3 for x in (times, forward, rows)]
        print(f"{name:40} {ms[0]:>9.1f} {ms[1]:>11.1f} {ms[2]:>8.2f} {sizes[name]:>13,}")


if __name__ == "__main__":
    main()
