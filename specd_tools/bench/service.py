"""``specd bench --service HOST:PORT``: a running service under 1, 4, 8, 16 concurrent streams.

Each level starts that many greedy streams at once, stream ``j`` sending the workload's prompt
``j mod n`` as chat messages, with speculation on and then off (per request, the API's
``speculation.enabled``; the order alternates per level so drift hits both alike). Reported
per workload, mode and level: aggregate tok/s (all streams' tokens over the level's wall
time), p50/p95 per-token latency (the gap between a stream's chunks divided by the chunk's
tokens, so a block of 8 accepted tokens spreads its wait over 8) and p50 time to first token.
Greedy outputs of a prompt must be identical in every stream, mode and level.
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

from ..workloads import Prompt, Workload, load_workloads

__all__ = ["ServiceBenchConfig", "StreamRecord", "run_service_bench"]


@dataclass(frozen=True)
class ServiceBenchConfig:
    """What ``specd bench --service`` runs.

    Attributes:
        service: ``host:port`` of a running ``specd serve``.
        workloads: names (None: all).
        max_new_tokens, repeats: as in-process; each >= 1.
        concurrency: stream counts, each >= 1.
        auth_token, tls_ca: as for ``specd generate --server``.
        model: unused by the service run (the service has its own); kept for the report.
        timeout_s: per stream.

    Raises:
        ValueError: a bad size or an empty concurrency list.
    """

    service: str
    workloads: tuple[str, ...] | None = None
    max_new_tokens: int = 128
    repeats: int = 1
    concurrency: tuple[int, ...] = (1, 4, 8, 16)
    auth_token: str | None = None
    tls_ca: str | None = None
    model: str | None = None
    timeout_s: float = 900.0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1 or self.repeats < 1:
            raise ValueError(f"max-new-tokens and repeats must be >= 1, got "
                             f"{self.max_new_tokens}, {self.repeats}")
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise ValueError(f"concurrency levels must be >= 1, got {self.concurrency}")
        if ":" not in self.service:
            raise ValueError(f"--service must be HOST:PORT, got {self.service!r}")


@dataclass
class StreamRecord:
    """One stream: its tokens and when each chunk arrived (seconds after the level began)."""

    workload: str
    prompt_id: str
    streams: int
    speculation: bool
    repeat: int
    tokens: list[int]
    chunk_times: list[float]
    chunk_sizes: list[int]
    seconds: float
    forward_calls: int


def _request(prompt: Prompt, max_new_tokens: int, speculation: bool):
    from specd.v1 import generation_pb2

    request = generation_pb2.GenerateRequest(
        max_new_tokens=max_new_tokens,
        speculation=generation_pb2.SpeculationOptions(enabled=speculation))
    for m in prompt.messages:
        request.chat.messages.add(role=m["role"], content=m["content"])
    return request


def _one_stream(config: ServiceBenchConfig, request, start: float) -> tuple:
    from ..client import stream_generate

    tokens, times, sizes, final = [], [], [], None
    for chunk in stream_generate(config.service, request, auth_token=config.auth_token,
                                 tls_ca=config.tls_ca, timeout_s=config.timeout_s):
        if chunk.token_ids:
            times.append(time.perf_counter() - start)
            sizes.append(len(chunk.token_ids))
            tokens.extend(chunk.token_ids)
        if chunk.finish_reason:
            final = chunk
    calls = final.speculation.forward_calls if final is not None else 0
    return tokens, times, sizes, time.perf_counter() - start, calls


def _pipeline_counters(config: ServiceBenchConfig) -> dict | None:
    """The service's step counters summed over replicas (Status RPC): steps, draft wait
    seconds, run-ahead hits and misses, and the steps-weighted target busy fraction; None
    when the service does not answer Status (an older server)."""
    import grpc

    from specd.v1 import generation_pb2, generation_pb2_grpc

    from ..client import open_channel

    metadata = [("authorization", f"Bearer {config.auth_token}")] if config.auth_token else None
    try:
        with open_channel(config.service, config.tls_ca) as channel:
            status = generation_pb2_grpc.GenerationStub(channel).Status(
                generation_pb2.StatusRequest(), metadata=metadata, timeout=30)
    except grpc.RpcError:
        return None
    out = {"steps": 0, "draft_wait_s": 0.0, "hits": 0, "misses": 0, "busy_steps": 0.0}
    for r in status.replicas:
        out["steps"] += r.steps
        out["draft_wait_s"] += r.draft_wait_seconds_per_step * r.steps
        out["hits"] += r.runahead_hits
        out["misses"] += r.runahead_misses
        out["busy_steps"] += r.target_busy_fraction * r.steps
    return out


def _level_metrics(before: dict | None, after: dict | None) -> dict:
    """Per-level pipelining metrics from two `_pipeline_counters` snapshots."""
    if before is None or after is None:
        return {}
    steps = after["steps"] - before["steps"]
    return {
        "steps": steps,
        "draft_wait_ms_per_step": (1e3 * (after["draft_wait_s"] - before["draft_wait_s"])
                                   / steps if steps else None),
        "runahead_hits": after["hits"] - before["hits"],
        "runahead_misses": after["misses"] - before["misses"],
        # Cumulative (the replicas' own counters since start), weighted by steps.
        "target_busy_fraction": (after["busy_steps"] / after["steps"]
                                 if after["steps"] else None),
    }


def run_service_bench(config: ServiceBenchConfig, progress=print,
                      workloads: list[Workload] | None = None) -> dict:
    """Runs every level of every workload; returns the JSON-ready report (``config``,
    ``levels`` rows, ``identity``, ``streams``).

    Args:
        workloads: instead of ``config.workloads`` (e.g. short prompts for a tiny model).

    Raises:
        grpc.RpcError: the service refused or failed a stream.
    """
    if workloads is None:
        workloads = load_workloads(list(config.workloads) if config.workloads else None)
    records: list[StreamRecord] = []
    metrics: dict[tuple, list[dict]] = {}
    # Warm-up: one short stream in each mode.
    first = workloads[0].prompts[0]
    for spec in (True, False):
        _one_stream(config, _request(first, 4, spec), time.perf_counter())
    for repeat in range(config.repeats):
        for w in workloads:
            for level_index, streams in enumerate(config.concurrency):
                modes = (True, False) if (repeat + level_index) % 2 == 0 else (False, True)
                for spec in modes:
                    prompts = [w.prompts[j % len(w.prompts)] for j in range(streams)]
                    before = _pipeline_counters(config)
                    start = time.perf_counter()
                    with ThreadPoolExecutor(streams) as pool:
                        results = list(pool.map(
                            lambda p, s=spec, t=start: _one_stream(
                                config, _request(p, config.max_new_tokens, s), t), prompts))
                    for p, (tokens, times, sizes, seconds, calls) in zip(prompts, results,
                                                                          strict=True):
                        records.append(StreamRecord(w.name, p.id, streams, spec, repeat, tokens,
                                                    times, sizes, seconds, calls))
                    metrics.setdefault((w.name, spec, streams), []).append(
                        _level_metrics(before, _pipeline_counters(config)))
                    wall = max(r[3] for r in results)
                    total = sum(len(r[0]) for r in results)
                    progress(f"{w.name} streams={streams} speculation={'on' if spec else 'off'}"
                             f" r{repeat}: {total / wall:.1f} tok/s aggregate")
    return {
        "config": asdict(config),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "levels": summarize_levels(records, metrics),
        "identity": stream_identity(records),
        "streams": [asdict(r) for r in records],
    }


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def summarize_levels(records: list[StreamRecord], metrics: dict | None = None) -> list[dict]:
    """One row per (workload, speculation, streams): aggregate tok/s (median over repeats),
    p50/p95 per-token latency in ms and p50 time to first token in s (over all streams);
    with ``metrics`` (`_level_metrics` per repeat, keyed like the rows) also the service's
    draft wait per step (ms), run-ahead hits and misses and target busy fraction (medians
    over repeats)."""
    keys = list(dict.fromkeys((r.workload, r.speculation, r.streams) for r in records))
    rows = []
    for workload, spec, streams in keys:
        mine = [r for r in records
                if (r.workload, r.speculation, r.streams) == (workload, spec, streams)]
        rates = []
        for repeat in sorted({r.repeat for r in mine}):
            batch = [r for r in mine if r.repeat == repeat]
            wall = max(r.seconds for r in batch)
            rates.append(sum(len(r.tokens) for r in batch) / wall if wall > 0 else 0.0)
        per_token, first = [], []
        for r in mine:
            if r.chunk_times:
                first.append(r.chunk_times[0])
            for i in range(1, len(r.chunk_times)):
                gap = 1e3 * (r.chunk_times[i] - r.chunk_times[i - 1]) / r.chunk_sizes[i]
                per_token.extend([gap] * r.chunk_sizes[i])
        rows.append({
            "workload": workload, "speculation": spec, "streams": streams,
            "tok_s": statistics.median(rates),
            "p50_ms_per_token": _percentile(per_token, 50),
            "p95_ms_per_token": _percentile(per_token, 95),
            "p50_first_token_s": statistics.median(first) if first else None,
            "forward_calls_per_stream": statistics.mean(r.forward_calls for r in mine),
            **_median_metrics((metrics or {}).get((workload, spec, streams), [])),
        })
    return rows


def _median_metrics(levels: list[dict]) -> dict:
    keys = ("draft_wait_ms_per_step", "runahead_hits", "runahead_misses",
            "target_busy_fraction")
    out = {}
    for key in keys:
        values = [m[key] for m in levels if m.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    return out


def stream_identity(records: list[StreamRecord]) -> dict:
    """Whether every stream of a prompt produced the first one's tokens (greedy)."""
    reference: dict[tuple[str, str], list[int]] = {}
    mismatches = []
    for r in records:
        ref = reference.setdefault((r.workload, r.prompt_id), r.tokens)
        if r.tokens != ref:
            mismatches.append({"workload": r.workload, "prompt_id": r.prompt_id,
                               "streams": r.streams, "speculation": r.speculation,
                               "repeat": r.repeat})
    return {"identical": not mismatches, "compared_runs": len(records),
            "mismatches": mismatches}
