"""Is drafting ever slower than plain decoding? Each drafter against ``--drafter none``
through the service a user gets (embedded Ray, gRPC drafter worker, adaptive, pipelined),
per shipped workload, in one run.

One embedded service per drafter (same defaults as ``specd serve --drafter NAME``), all on
one local Ray; every prompt of every workload (`specd_tools.workloads`: code_edit,
summarise, chat, open_question) is generated greedily by each service back to back, the
order rotated per prompt and round, so machine drift hits all alike. Printed per workload and
drafter: decode tok/s (tokens after the first over the time after the first, streamed) and
its ratio to plain decoding (the figure to read on a shared machine), and whether greedy
outputs were identical to plain decoding's.

    python benchmarks/drafting_floor.py                       # SmolLM2, 128 tokens, 1 round
    python benchmarks/drafting_floor.py --drafters prompt-lookup suffix --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import grpc

from specd.v1 import generation_pb2, generation_pb2_grpc


def _request(messages, max_new: int) -> generation_pb2.GenerateRequest:
    req = generation_pb2.GenerateRequest(max_new_tokens=max_new)
    for m in messages:
        req.chat.messages.add(role=m["role"], content=m["content"])
    return req


def _decode(address: str, req) -> tuple[list[int], float, int]:
    """(tokens, seconds after the first streamed chunk, tokens after that chunk)."""
    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        tokens, first = [], None
        for chunk in stub.Generate(req, timeout=900):
            if first is None and chunk.token_ids:
                first = time.perf_counter()
                first_n = len(chunk.token_ids)
            tokens.extend(chunk.token_ids)
        ended = time.perf_counter()
    return tokens, (ended - first) if first is not None else 0.0, len(tokens) - (
        first_n if first is not None else 0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--drafters", nargs="+",
                   default=["prompt-lookup", "suffix", "suffix+lookup"])
    p.add_argument("--workloads", nargs="*", default=None)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--target-threads", type=int, default=None)
    args = p.parse_args(argv)

    from coordinator.cluster.config import ServiceConfig
    from coordinator.cluster.service import Service, init_embedded_ray
    from drafter_worker.registry import default_draft_len
    from specd_tools.workloads import load_workloads

    workloads = load_workloads(args.workloads)
    init_embedded_ray()
    names = ["none", *args.drafters]
    services = {}
    for name in names:
        services[name] = Service(ServiceConfig(model=args.model, port=0, drafter=name,
                                               max_draft_len=default_draft_len(name, True),
                                               target_threads=args.target_threads))
        services[name].start()
    rows: dict[tuple[str, str], list[tuple[int, float]]] = {}
    mismatches = []
    load_before = os.getloadavg()
    try:
        warm = _request(workloads[0].prompts[0].messages, 16)
        for service in services.values():  # calibration, first allocations
            _decode(service.address, warm)
        i = 0
        for rnd in range(args.rounds):
            for w in workloads:
                for prompt in w.prompts:
                    req = _request(prompt.messages, args.max_new_tokens)
                    k = i % len(names)
                    i += 1
                    outs = {}
                    for name in names[k:] + names[:k]:
                        tokens, seconds, n = _decode(services[name].address, req)
                        outs[name] = tokens
                        rows.setdefault((w.name, name), []).append((n, seconds))
                    if any(outs[n] != outs["none"] for n in names):
                        mismatches.append((rnd, w.name, prompt.id))
                    print(f"  {w.name}/{prompt.id} done", flush=True)
    finally:
        for service in services.values():
            service.stop()
    report = {"model": args.model or "SmolLM2-135M-Instruct",
              "max_new_tokens": args.max_new_tokens, "rounds": args.rounds,
              "load_before": load_before, "load_after": os.getloadavg(),
              "greedy_mismatches": mismatches, "workloads": {}}
    for w in workloads:
        plain = rows[(w.name, "none")]
        plain_tps = sum(n for n, _ in plain) / sum(s for _, s in plain)
        entry = {}
        for name in names:
            got = rows[(w.name, name)]
            tps = sum(n for n, _ in got) / sum(s for _, s in got)
            per_prompt = [(n / s) / (pn / ps) for (n, s), (pn, ps) in zip(got, plain,
                                                                           strict=True)]
            entry[name] = {"decode_tok_s": round(tps, 2), "vs_plain": round(tps / plain_tps, 3),
                           "worst_prompt_vs_plain": round(min(per_prompt), 3),
                           "median_prompt_vs_plain": round(statistics.median(per_prompt), 3)}
        report["workloads"][w.name] = entry
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
