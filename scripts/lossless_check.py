"""Is a running server lossless, bitwise, on the served path? Greedy chat completions with
log probabilities of MT-Bench first turns (3 per category by default), three ways:

  (a) ``speculation: {enabled: false}``, one request at a time: plain decoding;
  (b) the server's default drafting, ``--concurrency`` requests at a time;
  (c) the server's default drafting, one at a time;

then compares (b) and (c) with (a): texts that differ, the share of token log probabilities
bitwise equal (the JSON numbers, as sent), the largest difference. A lossless server reads
0 / N, 0 / N, 100%, 0.0.

    specd serve --http-port 8000 --dtype bfloat16 &
    python scripts/lossless_check.py --base-url http://127.0.0.1:8000/v1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specd_tools.bench.serve_data import MT_BENCH_FILE  # noqa: E402


def questions(per_category: int) -> list[str]:
    rows = [json.loads(line) for line in MT_BENCH_FILE.read_text().splitlines() if line]
    picked: dict[str, list[str]] = {}
    for row in rows:
        got = picked.setdefault(row["category"], [])
        if len(got) < per_category:
            got.append(row["turns"][0])
    return [q for qs in picked.values() for q in qs]


async def ask(client, model: str, question: str, max_tokens: int, speculate: bool):
    extra = {} if speculate else {"speculation": {"enabled": False}}
    out = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": question}], max_tokens=max_tokens,
        temperature=0, logprobs=True, top_logprobs=1, extra_body=extra)
    choice = out.choices[0]
    return choice.message.content, [t.logprob for t in choice.logprobs.content]


async def run(client, model, prompts, max_tokens, speculate: bool, concurrency: int):
    gate = asyncio.Semaphore(concurrency)

    async def one(q):
        async with gate:
            return await ask(client, model, q, max_tokens, speculate)

    return await asyncio.gather(*(one(q) for q in prompts))


def compare(reference, other) -> tuple[int, float, float]:
    """(texts that differ, share of token logprobs bitwise equal, largest difference)."""
    differ, equal, total, worst = 0, 0, 0, 0.0
    for (text_a, lp_a), (text_b, lp_b) in zip(reference, other, strict=True):
        differ += text_a != text_b
        for a, b in zip(lp_a, lp_b, strict=False):
            total += 1
            equal += a == b
            worst = max(worst, abs(a - b))
        total += abs(len(lp_a) - len(lp_b))
    return differ, equal / max(total, 1), worst


async def main_async(args) -> int:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=args.base_url, api_key=args.api_key or "none")
    model = args.model or (await client.models.list()).data[0].id
    prompts = questions(args.per_category)
    plain = await run(client, model, prompts, args.max_tokens, False, 1)
    batched = await run(client, model, prompts, args.max_tokens, True, args.concurrency)
    alone = await run(client, model, prompts, args.max_tokens, True, 1)
    db, eb, wb = compare(plain, batched)
    da, ea, wa = compare(plain, alone)
    n = len(prompts)
    print(f"{n} prompts, greedy, {args.max_tokens} tokens, model {model}")
    print("| texts that differ from (a): (b) / (c) | token logprobs bitwise equal to (a) "
          "| largest logprob difference |")
    print("|---|---|---|")
    print(f"| {db} / {n}, {da} / {n} | {min(eb, ea):.1%} | {max(wb, wa):.3g} |")
    return 0 if db == da == 0 and eb == ea == 1.0 else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", default=None)
    p.add_argument("--api-key", default=None)
    p.add_argument("--per-category", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--concurrency", type=int, default=8)
    return asyncio.run(main_async(p.parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
