"""Pipelined vs serial vs auto service steps, and the service beside the in-process core, in
one run.

Three embedded services on one local Ray, identical but for ``pipeline`` (``specd serve
--pipeline on``, ``--pipeline off`` and ``--pipeline auto``, which measures both as it runs
and keeps the faster), run the same greedy requests at each stream count, rounds
interleaved (the order rotates) so machine drift hits them alike; then the in-process core
(`speculative_decode_with`, the same drafter, adaptive) runs the 1-stream requests. Printed per
mode and stream count: aggregate tok/s (median over rounds), and the step budget from the
replica's own counters over that level, in ms per verification step: waiting for drafts
before the verify could start, the verify call as the coordinator sees it (transport
included), prefill calls spread over the steps, and the rest (the rule, bookkeeping, the
loop); beside it the replica's own compute (forward + rows, prefills included); run-ahead
hits and misses; the target busy fraction (that compute over the loop's busy time); for auto,
the steps it ran pipelined / serial at that level. Greedy outputs must be identical in every
mode, round and stream (checked). ``--modes`` picks a subset.

    python benchmarks/pipeline.py                      # tiny model, prompt lookup
    python benchmarks/pipeline.py --model default --drafter eagle+lookup --streams 8 \\
        --max-new-tokens 128 --rounds 2               # SmolLM2, mixed workloads
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from specd.v1 import generation_pb2, generation_pb2_grpc

PROMPTS = Path(__file__).resolve().parent / "prompts"
#: ``--modes``: each service's `ServiceConfig` ``pipeline``.
MODES = {"pipelined": True, "serial": False, "auto": "auto"}
#: Tiny-model prompts: short (its context is 256 tokens), different per stream.
TINY_PROMPTS = ("def add(a, b):\n    return a + b\n", "The quick brown fox jumps over",
                "SELECT name, count(*) FROM users", "for i in range(10):\n    print(i)")


def _request(text: str, max_new: int, chat: bool) -> generation_pb2.GenerateRequest:
    req = generation_pb2.GenerateRequest(max_new_tokens=max_new)
    if chat:
        req.chat.messages.add(role="user", content=text)
    else:
        req.text = text
    return req


def _stream(address: str, req) -> list[int]:
    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        return [t for chunk in stub.Generate(req, timeout=900) for t in chunk.token_ids]


def _level(address: str, reqs: list) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    with ThreadPoolExecutor(len(reqs)) as pool:
        outs = list(pool.map(lambda r: _stream(address, r), reqs))
    return sum(map(len, outs)) / (time.perf_counter() - start), outs


def _counters(service) -> dict:
    replica = service.status()["replicas"][0]
    keys = ("steps", "active_seconds", "draft_wait_seconds", "target_verify_seconds",
            "target_verify_calls", "target_prefill_seconds", "runahead_hits",
            "runahead_misses", "tokens_emitted", "pipelined_steps", "serial_steps")
    return {k: float(replica.get(k, 0)) for k in keys}


def _schedule_costs(service) -> str:
    """What an auto service's replica measured per bucket of active requests (`Status`'s
    ``schedule_costs``), ms per committed token pipelined / serial, its choice starred."""
    replica = service.status()["replicas"][0]
    cells = []
    for c in replica.get("schedule_costs", []):
        p, s = c["pipelined_seconds_per_token"] * 1e3, c["serial_seconds_per_token"] * 1e3
        cells.append(f"{c['active_requests']} active: {p:.3f}{'*' * (c['best'] == 'pipelined')}"
                     f" / {s:.3f}{'*' * (c['best'] == 'serial')}")
    return "; ".join(cells) + f" ({replica.get('schedule_switches', 0)} switches)"


def _busy(service) -> float:
    import ray

    handles = ray.get(service.coordinator.replica_handles.remote())
    stats = ray.get(next(iter(handles.values())).status.remote())["stats"]
    return stats.get("forward_seconds", 0.0) + stats.get("rows_seconds", 0.0)


def _budget(before: dict, after: dict, busy: float) -> dict:
    d = {k: after[k] - before[k] for k in after}
    steps = max(d["steps"], 1.0)
    verify = d["target_verify_seconds"] / max(d["target_verify_calls"], 1.0)
    step = d["active_seconds"] / steps
    wait = d["draft_wait_seconds"] / steps
    prefill = d["target_prefill_seconds"] / steps
    return {
        "step_ms": step * 1e3, "wait_ms": wait * 1e3, "verify_ms": verify * 1e3,
        "prefill_ms": prefill * 1e3, "compute_ms": busy / steps * 1e3,
        "rest_ms": (step - wait - verify - prefill) * 1e3,
        "hits": int(d["runahead_hits"]), "misses": int(d["runahead_misses"]),
        "busy": busy / d["active_seconds"] if d["active_seconds"] else 0.0,
        "tokens_per_step": d["tokens_emitted"] / steps,
        "pipelined_steps": int(d["pipelined_steps"]), "serial_steps": int(d["serial_steps"]),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-random",
                   help="tiny-random[:...] (default), 'default' for SmolLM2, or a .gguf")
    p.add_argument("--drafter", default="prompt-lookup")
    p.add_argument("--streams", default="1,8", help="stream counts, comma separated")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--target-threads", type=int, default=1)
    p.add_argument("--modes", default="pipelined,serial,auto",
                   help="services to compare, comma separated: pipelined, serial, auto")
    args = p.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - set(MODES):
        p.error(f"--modes: each of {', '.join(MODES)}, got {args.modes!r}")

    from coordinator.cluster.config import ServiceConfig
    from coordinator.cluster.service import Service, init_embedded_ray
    from target_worker.testing import is_tiny_random_spec

    model = None if args.model == "default" else args.model
    tiny = is_tiny_random_spec(model)
    if tiny:
        texts, chat = list(TINY_PROMPTS), False
    else:
        texts = [(PROMPTS / f"{n}.txt").read_text() for n in ("code_edit", "open_question")]
        chat = True
    streams = [int(s) for s in args.streams.split(",")]
    init_embedded_ray()
    services = {}
    for mode in modes:
        services[mode] = Service(ServiceConfig(
            model=model, port=0, drafter=args.drafter, target_threads=args.target_threads,
            pipeline=MODES[mode]))
        services[mode].start()
    rates = {(m, n): [] for m in services for n in streams}
    budgets = {(m, n): [] for m in services for n in streams}
    reference: dict[int, list[int]] = {}
    try:
        for service in services.values():  # warm-up: calibration, first allocations
            _level(service.address, [_request(texts[0], 16, chat)])
        for rnd in range(args.rounds):
            for n in streams:
                reqs = [_request(texts[i % len(texts)], args.max_new_tokens, chat)
                        for i in range(n)]
                shift = rnd % len(services)
                order = list(services)[shift:] + list(services)[:shift]
                for mode in order:
                    service = services[mode]
                    before, busy0 = _counters(service), _busy(service)
                    rate, outs = _level(service.address, reqs)
                    budgets[mode, n].append(_budget(before, _counters(service),
                                                    _busy(service) - busy0))
                    rates[mode, n].append(rate)
                    for i, out in enumerate(outs):
                        ref = reference.setdefault(i % len(texts), out)
                        assert out == ref, f"{mode}, {n} streams: output {i} differs"
        measured = _schedule_costs(services["auto"]) if "auto" in services else None
    finally:
        for service in services.values():
            service.stop()

    in_process = None
    if 1 in streams:
        in_process = _in_process(model, args, texts[0], chat, reference.get(0))
    print(f"\nmodel {args.model}, drafter {args.drafter}, {args.max_new_tokens} new tokens, "
          f"median of {args.rounds} rounds, target threads {args.target_threads}")
    print(f"{'mode':10} {'streams':>7} {'tok/s':>8} {'step ms':>8} {'wait':>6} {'verify':>7} "
          f"{'prefill':>8} {'rest':>6} {'compute':>8} {'tok/step':>8} {'hits':>6} "
          f"{'misses':>6} {'busy':>5} {'P/S steps':>12}")
    for n in streams:
        for mode in services:
            b = {k: statistics.median(x[k] for x in budgets[mode, n]) for k in budgets[mode, n][0]}
            print(f"{mode:10} {n:>7} {statistics.median(rates[mode, n]):>8.0f} "
                  f"{b['step_ms']:>8.2f} {b['wait_ms']:>6.2f} {b['verify_ms']:>7.2f} "
                  f"{b['prefill_ms']:>8.2f} {b['rest_ms']:>6.2f} {b['compute_ms']:>8.2f} "
                  f"{b['tokens_per_step']:>8.2f} {b['hits']:>6.0f} {b['misses']:>6.0f} "
                  f"{b['busy']:>5.2f} "
                  f"{b['pipelined_steps']:>5.0f}/{b['serial_steps']:<6.0f}")
    print()
    for n in streams:
        rate = {m: statistics.median(rates[m, n]) for m in services}
        print(f"at {n} stream(s): " + ", ".join(
            f"{a} / {b} {rate[a] / rate[b]:.2f}x" for a, b in itertools.combinations(services, 2)))
    if measured:
        print(f"auto's measurements, ms per committed token: {measured}")
    if in_process is not None:
        print(f"in-process core, 1 stream: {in_process:.0f} tok/s; " + ", ".join(
            f"{m} / in-process {statistics.median(rates[m, 1]) / in_process:.2f}x"
            for m in services))


def _in_process(model, args, text: str, chat: bool, expected: list[int] | None) -> float:
    """tok/s of the in-process core on the 1-stream request (median of ``args.rounds``)."""
    import torch

    from coordinator.step.adaptive import AdaptiveDraftLength, calibrate_for
    from coordinator.step.speculative import speculative_decode_with
    from drafter_worker.registry import build_drafter
    from specd_core.request import SpeculativeOptions
    from specd_core.text import encode_prompt
    from target_worker.loader import load_model

    torch.set_num_threads(args.target_threads)
    decoder, tokenizer = load_model(model)
    prompt = encode_prompt(tokenizer, text, raw=not chat)
    drafter = build_drafter(args.drafter, model=model)
    cost = calibrate_for(decoder)
    rates = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        out = speculative_decode_with(
            decoder, prompt, decoder.new_cache(), drafter,
            SpeculativeOptions(max_new_tokens=args.max_new_tokens,
                               stop_token_ids=_stops(tokenizer)),
            adaptive=AdaptiveDraftLength(cost))
        rates.append(len(out.generated_tokens) / (time.perf_counter() - start))
        if expected is not None:
            assert out.generated_tokens == expected, "in-process output differs"
    return statistics.median(rates)


def _stops(tokenizer) -> tuple[int, ...]:
    eos = getattr(tokenizer, "eos_token_id", None)
    return () if eos is None else (int(eos),)


if __name__ == "__main__":
    main()
