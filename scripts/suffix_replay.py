"""Replays greedy outputs through the drafters: how suffix decoding's settings were chosen.

At temperature 0 a draft token is accepted exactly when it equals the target's greedy token,
so once each prompt's greedy output is known, any drafter can be scored offline, without the
model: each step asks the drafter for a block (adaptive draft length, `AdaptiveDraftLength`),
accepts its prefix that matches the output, commits one more token, and charges the step the
target's forward cost for ``drafts + 1`` tokens. Printed per drafter and workload: tokens per
target forward and the estimated speed over plain decoding (plain's cost over the replay's).
It leaves out the drafter's own CPU time and pipelining, so the service's measured ratios
(`benchmarks/suffix_workload.py`, `benchmarks/drafting_floor.py`) are the ones to quote; this is
the quick, noise-free way to compare settings.

    python scripts/suffix_replay.py generate outputs.json            # greedy outputs (minutes)
    python scripts/suffix_replay.py replay outputs.json              # the comparison (seconds)
    python scripts/suffix_replay.py memory outputs.json              # 10,000 outputs' footprint

``generate`` decodes, greedily with SmolLM2-135M-Instruct (plain decoding, 1 thread), 64
requests of the repeated-structure workload (up to 96 tokens; replayed in order, the first
12 only warm the cache) and, as the "mixed" set, every prompt of the shipped workloads plus 2
MT-Bench questions of each category (up to 128 tokens). The forward costs are this machine's
(environment notes: one forward over a 300-token cache, k = 1 57 ms, 2-8 ~97 ms, 16 114 ms,
32 143 ms); ``--cost N:SECONDS`` replaces them.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: Forward seconds by tokens fed (this machine, SmolLM2, 300-token cache).
COSTS = {1: 0.057, 2: 0.097, 4: 0.099, 8: 0.097, 16: 0.114, 32: 0.143}
#: Repeated-structure requests replayed only to warm the cache.
WARMUP = 12


def generate(path: Path) -> None:
    import torch

    from coordinator.step.speculative import speculative_decode_with
    from specd_core.request import SpeculativeOptions
    from specd_core.text import encode_prompt
    from specd_tools.bench.serve_data import MT_BENCH_FILE
    from specd_tools.workloads import WORKLOADS, load_workload
    from specd_tools.workloads.structured import structured_requests
    from target_worker.loader import load_model

    torch.set_num_threads(1)
    decoder, tok = load_model(None)
    items = [("structured", kind, encode_prompt(tok, text, False), 96)
             for kind, text in structured_requests(64, 0)]
    chats = [(w, list(p.messages)) for w in WORKLOADS for p in load_workload(w).prompts]
    taken: dict[str, int] = {}
    for line in MT_BENCH_FILE.read_text().splitlines():
        q = json.loads(line)
        if taken.get(q["category"], 0) < 2:
            taken[q["category"]] = taken.get(q["category"], 0) + 1
            chats.append(("mt-bench", [{"role": "user", "content": q["turns"][0]}]))
    for kind, messages in chats:
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if not isinstance(ids, list) else ids
        items.append(("mixed", kind, [int(t) for t in ids], 128))
    out = []
    for i, (workload, kind, prompt, max_new) in enumerate(items):
        result = speculative_decode_with(
            decoder, prompt, decoder.new_cache(), None,
            SpeculativeOptions(max_new_tokens=max_new, stop_token_ids=(tok.eos_token_id,)))
        out.append({"set": workload, "kind": kind, "prompt": prompt,
                    "output": list(result.generated_tokens)})
        print(f"{i + 1}/{len(items)} {workload}/{kind}: {len(result.generated_tokens)} tokens",
              file=sys.stderr, flush=True)
    path.write_text(json.dumps(out))


def replay(records: list[dict], make, tail: int, costs: dict[int, float]) -> dict[str, list]:
    """``{kind: [tokens, replay seconds, plain seconds, steps]}`` for one drafter, the
    records replayed in order through one drafter object (its cache fills as a service's);
    ``tail``: prompt tokens remembered before each output."""
    from coordinator.step.adaptive import AdaptiveDraftLength, ForwardCostModel

    cost = ForwardCostModel(costs, alpha=0)
    drafter = make()
    per: dict[str, list] = defaultdict(lambda: [0, 0.0, 0.0, 0])
    for i, r in enumerate(records):
        out, history, done = r["output"], list(r["prompt"]), 0
        session = drafter.session() if hasattr(drafter, "session") else drafter
        policy = AdaptiveDraftLength(cost)
        seconds, steps = 0.0, 0
        while done < len(out):
            k = policy.next_len(len(out) - done - 1, 32)
            block = list(session.propose(history, None, k).tokens)[:k] if k > 0 else []
            accepted = 0
            while accepted < len(block) and block[accepted] == out[done + accepted]:
                accepted += 1
            new = out[done:done + accepted + 1]
            done += len(new)
            history += new
            policy.update(len(block), accepted)
            seconds += cost.cost(len(block) + 1)
            steps += 1
        if hasattr(drafter, "remember"):
            drafter.remember([(r["prompt"][-tail:] if tail else []) + out])
        if r["set"] == "structured" and i < WARMUP:
            continue
        row = per[r["kind"] if r["set"] == "mixed" else "structured"]
        row[0] += len(out)
        row[1] += seconds
        row[2] += len(out) * cost.cost(1)
        row[3] += steps
    return per


def drafters():
    """(label, factory, prompt tail) of each compared drafter."""
    from coordinator.step.drafting import REMEMBER_PROMPT_TAIL
    from drafter_worker.prompt_lookup import PromptLookupSpeculator
    from drafter_worker.registry import build_drafter
    from drafter_worker.suffix import SuffixDrafter

    paper = {"max_spec_factor": 1.0, "min_token_prob": 0.1, "cache_min_token_prob": 0.1,
             "cache_min_match": 1}
    return [
        ("prompt-lookup", lambda: build_drafter("prompt-lookup", max_draft_len=32), 0),
        ("suffix, paper's settings", lambda: SuffixDrafter(32, **paper), 0),
        ("suffix, paper's + prompt tail",
         lambda: SuffixDrafter(32, **paper), REMEMBER_PROMPT_TAIL),
        ("suffix (specd's defaults)",
         lambda: build_drafter("suffix", max_draft_len=32), REMEMBER_PROMPT_TAIL),
        ("suffix+lookup (specd's defaults)",
         lambda: SuffixDrafter(32, lookup=PromptLookupSpeculator(3, 32)), REMEMBER_PROMPT_TAIL),
    ]


def memory(records: list[dict], n: int = 10_000) -> dict:
    """The global cache after ``n`` of the structured outputs (cycled, a sixth of each
    output's tokens replaced by random ids, as field values vary), each after its prompt
    tail."""
    from coordinator.step.drafting import remembered_tokens
    from drafter_worker.suffix import SuffixCache

    rng = random.Random(0)
    structured = [r for r in records if r["set"] == "structured"]
    cache = SuffixCache()
    for i in range(n):
        r = structured[i % len(structured)]
        out = [t if rng.random() > 1 / 6 else rng.randrange(49152) for t in r["output"]]
        cache.add(remembered_tokens(r["prompt"] + out, len(r["prompt"]), out))
    return cache.stats()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=("generate", "replay", "memory"))
    p.add_argument("outputs", type=Path, help="the greedy outputs' JSON file")
    p.add_argument("--cost", action="append", default=[], metavar="N:SECONDS",
                   help="a forward cost point (repeatable; replaces the defaults)")
    args = p.parse_args(argv)
    if args.command == "generate":
        generate(args.outputs)
        return 0
    records = json.loads(args.outputs.read_text())
    if args.command == "memory":
        print(json.dumps(memory(records)))
        return 0
    costs = {int(n): float(s) for n, s in (c.split(":") for c in args.cost)} or COSTS
    print("estimated speed over plain decoding (tokens per target forward)")
    for label, make, tail in drafters():
        per = replay(records, make, tail, costs)
        cells = [f"{kind} {row[2] / row[1]:.2f}x ({row[0] / row[3]:.2f})"
                 for kind, row in per.items()]
        print(f"{label}: " + ", ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
