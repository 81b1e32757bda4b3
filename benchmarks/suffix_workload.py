"""Suffix decoding on a repeated-structure workload: plain decoding vs each drafter, one run.

The workload (`specd_tools.workloads.structured`): many requests whose answers share a form
while their prompts differ: JSON extraction, SQL, small Python functions with docstrings, tool
calls; fields drawn from fixed lists with a seeded generator. An agent or a batch job sends such
requests all day; suffix decoding drafts each answer from the earlier answers' suffix tree.

**In-process part** (default): every request is generated greedily by every system back to
back (`speculative_decode_with`, adaptive draft lengths, the pipelined schedule), the order
rotated per request so machine drift hits all systems alike; a drafter object lives across
requests, so the suffix drafters' global cache fills as a service's would. The first
``--warmup`` requests fill the cache and are not scored. Printed per system: decode tok/s
(tokens after the first over the time after the first; the ratio to plain is the figure to
read on a busy machine), tokens per target forward (verification steps), accept rate (overall
and at the first 8 draft positions), and for
the suffix drafters the global cache's hit rate (proposals whose draft came from previous
outputs) and size. Greedy outputs must be identical across systems (checked).

**Workers part** (``--workers 1 2``): the same requests through an in-process service (the
production `Router`, local target engines, one gRPC drafter server per worker, each its own
`SuffixDrafter` as separate processes would have) at ``--concurrency`` streams: the global
hit rate with 1 and 2 drafter workers (finished outputs are sent to every worker).

    python benchmarks/suffix_workload.py                            # SmolLM2, 48 requests
    python benchmarks/suffix_workload.py --requests 24 --workers 1 2 --max-new-tokens 64
    python benchmarks/suffix_workload.py --model tiny-random:vocab=64,seed=0,layers=2 --raw
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

from specd_tools.workloads.structured import structured_requests

#: Systems by drafter name ("none": plain decoding).
SYSTEMS = ("none", "prompt-lookup", "suffix", "suffix+lookup")

def _build(name: str, max_draft_len: int):
    from drafter_worker.registry import build_drafter

    return None if name == "none" else build_drafter(name, max_draft_len=max_draft_len)


def in_process(args, decoder, tokenizer, prompts: list[list[int]]) -> dict:
    """Every prompt through every system, interleaved; per-system totals after warm-up."""
    from coordinator.step.adaptive import AdaptiveDraftLength, calibrate_for
    from coordinator.step.speculative import speculative_decode_with
    from specd_core.request import SpeculativeOptions

    cost = calibrate_for(decoder, repeats=2)
    drafters = {name: _build(name, args.max_draft_len) for name in args.systems}
    stops = tuple(t for t in (tokenizer.eos_token_id,) if t is not None) if tokenizer else ()
    totals = {name: {"tokens": 0, "decode_s": 0.0, "steps": 0, "drafted": 0, "accepted": 0,
                     "evaluated_at": [], "accepted_at": []} for name in args.systems}
    mismatches = []
    for i, prompt in enumerate(prompts):
        names = list(args.systems)
        k = i % len(names)
        outs = {}
        for name in names[k:] + names[:k]:
            first: list[float] = []
            began = time.perf_counter()
            result = speculative_decode_with(
                decoder, prompt, decoder.new_cache(), drafters[name],
                SpeculativeOptions(max_new_tokens=args.max_new_tokens, stop_token_ids=stops),
                on_tokens=lambda t, first=first: first or first.append(time.perf_counter()),
                adaptive=None if drafters[name] is None else AdaptiveDraftLength(cost),
                pipeline=True)
            ended = time.perf_counter()
            outs[name] = result.generated_tokens
            if i < args.warmup:
                continue
            row = totals[name]
            row["tokens"] += max(0, len(result.generated_tokens) - 1)
            row["decode_s"] += ended - (first[0] if first else began)
            row["steps"] += result.verification_steps
            row["drafted"] += result.drafted_tokens
            row["accepted"] += result.accepted_tokens
            for key, per in (("evaluated_at", result.evaluated_at_position),
                             ("accepted_at", result.accepted_at_position)):
                row[key].extend([0] * (len(per) - len(row[key])))
                for j, v in enumerate(per):
                    row[key][j] += v
        if len({tuple(v) for v in outs.values()}) > 1:
            mismatches.append(i)
        if args.progress:
            print(f"  request {i + 1}/{len(prompts)} done", flush=True)
    report = {}
    plain = totals.get("none")
    for name, row in totals.items():
        tps = row["tokens"] / row["decode_s"] if row["decode_s"] else 0.0
        entry = {
            "decode_tok_s": round(tps, 2),
            "tokens_per_forward": round(row["tokens"] / row["steps"], 3)
            if row["steps"] else None,
            "accept_rate": round(row["accepted"] / row["drafted"], 3) if row["drafted"] else None,
            "accept_rate_per_position": [round(a / e, 2) for a, e in zip(
                row["accepted_at"], row["evaluated_at"], strict=False) if e][:8],
        }
        if plain and plain["decode_s"] and plain["tokens"]:
            entry["vs_plain"] = round(tps / (plain["tokens"] / plain["decode_s"]), 3)
        stats = getattr(drafters[name], "stats", None)
        if callable(stats):
            s = stats()
            entry["global_hit_rate"] = round(s["global_hit_rate"], 3)
            entry["cache"] = s["cache"]
        report[name] = entry
    return {"systems": report, "greedy_mismatches": mismatches}


async def _service_hit_rate(args, decoder, prompts: list[list[int]], workers: int,
                            eos: int | None) -> dict:
    """The requests through an in-process service with ``workers`` drafter workers."""
    from coordinator.cluster.router import Router
    from coordinator.step.targets import LocalTarget
    from drafter_worker.client import DrafterClient
    from drafter_worker.server import start_drafter_server
    from drafter_worker.suffix import SuffixDrafter
    from specd_core.request import SpeculativeOptions
    from target_worker.engine import TargetEngine

    servers, drafters = [], []

    async def start_replica(name):
        engine = TargetEngine(decoder, max_slots=args.concurrency)

        async def stop():
            return None

        return LocalTarget(engine), stop, {"vocab_size": decoder.config.vocab_size,
                                           "max_seq_len": decoder.config.max_seq_len}

    async def start_drafter(name):
        drafter = SuffixDrafter(max_draft_len=args.max_draft_len)
        server, port = await start_drafter_server(drafter)
        servers.append(server)
        drafters.append(drafter)

        async def stop():
            await server.stop(None)

        return DrafterClient(f"127.0.0.1:{port}", timeout_s=5.0), stop

    router = Router(start_replica, start_drafter, max_active=args.concurrency, adaptive=True,
                    pipeline=True)
    await router.scale(target_replicas=1, drafters=workers)
    stops = (eos,) if eos is not None else ()
    queue = list(prompts)

    async def stream():
        while queue:
            prompt = queue.pop(0)
            req = router.submit(prompt, SpeculativeOptions(max_new_tokens=args.max_new_tokens,
                                                           stop_token_ids=stops))
            while True:
                event = await req.events.get()
                if not isinstance(event, list):
                    break

    await asyncio.gather(*(stream() for _ in range(args.concurrency)))
    for replica in router.replicas.values():
        await replica.scheduler.settle_drafter()
    stats = [d.stats() for d in drafters]
    await router.close()
    proposals = sum(s["proposals"] for s in stats)
    wins = sum(s["global_wins"] for s in stats)
    return {"workers": workers, "proposals": proposals, "global_wins": wins,
            "global_hit_rate": round(wins / proposals, 3) if proposals else 0.0,
            "per_worker": [{"proposals": s["proposals"], "global_wins": s["global_wins"],
                            "cached_outputs": s["cache"]["outputs"]} for s in stats]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--warmup", type=int, default=12,
                        help="first requests that fill the cache, not scored")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--max-draft-len", type=int, default=32)
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--workers", nargs="*", type=int, default=[],
                        help="also measure the service's global hit rate with these drafter "
                             "worker counts (e.g. 1 2)")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--raw", action="store_true", help="no chat template")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--progress", action="store_true")
    parser.add_argument("--skip-in-process", action="store_true")
    args = parser.parse_args(argv)

    import torch

    from specd_core.text import encode_prompt
    from target_worker.loader import load_model

    torch.set_num_threads(args.threads)
    decoder, tokenizer = load_model(args.model)
    prompts = [encode_prompt(tokenizer, text, args.raw)
               for _, text in structured_requests(args.requests, args.seed)]
    room = decoder.config.max_seq_len - args.max_new_tokens
    prompts = [p[-room:] for p in prompts]
    report = {"model": args.model or "SmolLM2-135M-Instruct", "requests": args.requests,
              "warmup": args.warmup, "max_new_tokens": args.max_new_tokens,
              "load_before": os.getloadavg()}
    if not args.skip_in_process:
        report["in_process"] = in_process(args, decoder, tokenizer, prompts)
    if args.workers:
        eos = tokenizer.eos_token_id if tokenizer is not None else None
        report["service_hit_rate"] = [
            asyncio.run(_service_hit_rate(args, decoder, prompts, w, eos))
            for w in args.workers]
    report["load_after"] = os.getloadavg()
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
