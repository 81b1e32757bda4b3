"""Times llguidance's grammar masks on a model's vocabulary (default: SmolLM2-135M-Instruct's
tokenizer, 49,152 ids): what a constrained request adds to each step on the coordinator.

    python scripts/grammar_mask_cost.py                 # the default model's tokenizer
    python scripts/grammar_mask_cost.py --model tiny-random:vocab=128,ascii=1

Loads only the tokenizer. Prints, as one JSON object: the llguidance tokenizer's build time
(once per served model), each constraint's compile time (once per constraint, then cached),
and the time of one mask at the committed state and of one verify block's masks
(`GrammarMatcher.draft`: the drafter's ``k`` tokens walked, each position's mask filled,
walked on a copy), median / p90 / p99 in microseconds, over a walk that commits one random
allowed token (fixed seed) per step until the grammar ends, restarting as often as needed;
and the target's side, the bitmasks applied to one block's ``k + 1`` logits rows.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from coordinator.cluster.actor import load_tokenizer_for
from specd_core.draft import DraftBlock
from specd_core.grammar import GrammarCompiler, GrammarSpec, _allowed_ids
from specd_core.tool_calls import tool_format

SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["name", "age", "email", "tags", "address"],
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "vip"]}, "maxItems": 4},
        "address": {"type": "object", "additionalProperties": False,
                    "required": ["city", "zip"],
                    "properties": {"city": {"type": "string", "maxLength": 30},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}},
    },
}
CONSTRAINTS = {
    "json_schema": GrammarSpec("json_schema", SCHEMA),
    "json_object": GrammarSpec("json_object"),
    "regex": GrammarSpec("regex", r"[A-Z][a-z]{2,12} [0-9]{1,3}(, [A-Z][a-z]{2,12} [0-9]{1,3})*"),
    "choice": GrammarSpec("choice", ["positive", "negative", "neutral"]),
    # tool_choice "auto": free text (the walk rarely writes the trigger), then a call.
    "tools_auto": GrammarSpec("lark", tool_format("hermes").grammar(
        {"get_weather": SCHEMA, "ping": {"type": "object"}}), field="tools"),
}


def quantiles(us: list[float]) -> dict:
    a = np.array(us)
    return {"n": len(us), "median_us": round(float(np.median(a)), 1),
            "p90_us": round(float(np.quantile(a, 0.9)), 1),
            "p99_us": round(float(np.quantile(a, 0.99)), 1)}


def walk(grammar, vocab: int, steps: int, k: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    single, block = [], []
    m = grammar.matcher()
    for _ in range(steps):
        if m.stopped:
            m = grammar.matcher()
        t0 = time.perf_counter()
        row = m.mask()
        single.append((time.perf_counter() - t0) * 1e6)
        allowed = _allowed_ids(row, vocab)
        allowed = allowed[allowed != m.eos_token_id] if allowed.size > 1 else allowed
        # A k-token draft of allowed-looking tokens (the first one surely allowed).
        draft = [int(rng.choice(allowed))] + [int(rng.choice(allowed)) for _ in range(k - 1)]
        t0 = time.perf_counter()
        m.draft(DraftBlock.deterministic(draft), k)
        block.append((time.perf_counter() - t0) * 1e6)
        m.commit(draft[0])
    return {"mask": quantiles(single), f"block_k{k}": quantiles(block)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a model source (default: SmolLM2)")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--k", type=int, default=4, help="draft tokens per verify block")
    args = parser.parse_args()
    tokenizer = load_tokenizer_for(args.model)
    # The logits' width: the tokenizer's ids, added tokens included (49,152 for SmolLM2).
    vocab = max(getattr(tokenizer, "vocab_size", 0),
                len(tokenizer) if hasattr(tokenizer, "__len__") else 0)
    compiler = GrammarCompiler(tokenizer, vocab)
    t0 = time.perf_counter()
    compiler.ll_tokenizer()
    report = {"model": args.model or "SmolLM2-135M-Instruct", "vocab": vocab,
              "tokenizer_build_s": round(time.perf_counter() - t0, 3), "constraints": {}}
    for name, spec in CONSTRAINTS.items():
        t0 = time.perf_counter()
        grammar = compiler.compile(spec)
        compile_ms = (time.perf_counter() - t0) * 1e3
        report["constraints"][name] = {"compile_ms": round(compile_ms, 2),
                                       **walk(grammar, vocab, args.steps, args.k, seed=0)}
    # The target's side: the masks applied to a verify block's logits (k + 1 rows).
    import torch

    from specd_core.grammar import apply_token_bitmask

    torch.set_num_threads(1)  # as the target makes its rows (`invariant.one_thread`)
    logits = torch.randn(args.k + 1, vocab)
    masks = np.stack([grammar.matcher().mask()] * (args.k + 1))
    times = []
    for _ in range(200):
        t0 = time.perf_counter()
        apply_token_bitmask(logits, masks)
        times.append((time.perf_counter() - t0) * 1e6)
    report[f"apply_k{args.k}"] = quantiles(times)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
