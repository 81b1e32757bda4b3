"""Constrained (JSON schema) decoding with the default drafter against without, in process on
SmolLM2, one request at a time: tokens/s, forward calls, forced and grammar-refused drafts.

    python scripts/structured_speedup.py --num-prompts 6 --max-new-tokens 96

The prompts are `specd bench serve --dataset-name json-schema`'s (person, order, event
extraction, each with its schema); greedy, so both modes give the same tokens (checked).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import torch

from coordinator.step.adaptive import calibrate_for
from coordinator.step.scheduler import Scheduler
from coordinator.step.targets import LocalTarget
from drafter_worker.local import LocalDrafter
from drafter_worker.registry import DEFAULT_DRAFTER, build_drafter
from specd_core.grammar import GrammarCompiler, GrammarSpec
from specd_core.request import SpeculativeOptions
from specd_core.text import encode_prompt
from specd_tools.workloads.structured import json_schema_requests
from target_worker.engine import TargetEngine
from target_worker.loader import load_model


def run(decoder, prompts, options, drafter: bool, cost=None) -> tuple[float, list]:
    """Seconds and results of the requests one at a time; the adaptive draft length uses
    ``cost`` (calibrated once, outside the timing)."""
    async def go():
        local = LocalDrafter(build_drafter(DEFAULT_DRAFTER)) if drafter else None
        sched = Scheduler(LocalTarget(TargetEngine(decoder, max_slots=1)), local, max_active=1,
                          cost_model=cost)
        out = []
        for p, o in zip(prompts, options, strict=True):  # one at a time
            req = sched.submit(p, o)
            await sched.run_until_idle()
            assert req.cause is None, req.cause
            out.append(req.decode.result)
        return out

    t0 = time.perf_counter()
    results = asyncio.run(go())
    return time.perf_counter() - t0, results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    decoder, tokenizer = load_model()
    compiler = GrammarCompiler(tokenizer, decoder.config.vocab_size)
    requests = json_schema_requests(args.num_prompts, seed=0)
    prompts = [encode_prompt(tokenizer, text, raw=False) for _, text, _ in requests]
    options = [SpeculativeOptions(max_new_tokens=args.max_new_tokens,
                                  stop_token_ids=(tokenizer.eos_token_id,),
                                  grammar=compiler.compile(GrammarSpec("json_schema", s)))
               for _, _, s in requests]
    run(decoder, prompts[:1], options[:1], drafter=False)  # warm-up
    cost = calibrate_for(decoder)
    report = {}
    tokens = {}
    for name, drafter in (("plain", False), ("speculative", True)):
        seconds, results = run(decoder, prompts, options, drafter, cost)
        n = sum(r.tokens_generated for r in results)
        tokens[name] = [r.generated_tokens for r in results]
        report[name] = {"seconds": round(seconds, 2), "tokens": n,
                        "tok_per_s": round(n / seconds, 2),
                        "forward_calls": sum(r.forward_calls for r in results),
                        "forced_tokens": sum(r.forced_tokens for r in results),
                        "grammar_rejected_tokens": sum(r.grammar_rejected_tokens
                                                       for r in results),
                        "drafted": sum(r.drafted_tokens for r in results),
                        "accepted": sum(r.accepted_tokens for r in results)}
    report["same_tokens"] = tokens["plain"] == tokens["speculative"]
    report["speedup"] = round(report["speculative"]["tok_per_s"]
                              / report["plain"]["tok_per_s"], 2)
    report["example"] = tokenizer.decode(tokens["plain"][0], skip_special_tokens=True)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
