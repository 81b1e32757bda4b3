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

from drafter_worker.registry import LOOKUP_DRAFT_LEN

from .workloads import Prompt, Workload, load_workloads

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
    from .client import stream_generate

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

    from .client import open_channel

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


# --- The default user path against transformers -------------------------------------------

SPECD_GENERATE = "specd-generate"
SPECD_GENERATE_PLAIN = "specd-generate-drafter-none"


@dataclass(frozen=True)
class DefaultPathConfig:
    """What ``specd bench --default-path`` runs.

    Attributes:
        model: as for ``specd generate --model`` (None: the default SmolLM2).
        workloads: names (default code_edit and open_question, the issue's two cases).
        max_new_tokens: the same token budget for every system, >= 1.
        repeats: timed passes over every prompt, >= 1.
        prompt_lookup: transformers' ``prompt_lookup_num_tokens`` for hf-prompt-lookup.
        target_threads: ``specd generate --target-threads`` (None: its default).
        forward_ks, forward_cache_lens, forward_repeats: the forward timing run first
            (`specd_tools.bench.forward_timing`; empty ``forward_ks``: none).
        thread_check: time specd's forward at 1 and 2 threads, quiet and beside a busy
            process (`specd_tools.bench.thread_timing`).

    Raises:
        ValueError: a bad size.
    """

    model: str | None = None
    workloads: tuple[str, ...] | None = ("code_edit", "open_question")
    max_new_tokens: int = 160
    repeats: int = 3
    prompt_lookup: int = LOOKUP_DRAFT_LEN
    target_threads: int | None = None
    forward_ks: tuple[int, ...] = (1, 2, 4, 8, 32)
    forward_cache_lens: tuple[int, ...] = (300, 2000)
    forward_repeats: int = 15
    thread_check: bool = True

    def __post_init__(self) -> None:
        from .bench import check_forward_sizes

        check_forward_sizes(self.forward_ks, self.forward_cache_lens)
        for name in ("max_new_tokens", "repeats", "prompt_lookup", "forward_repeats"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name.replace('_', '-')} must be an int >= 1, got {value!r}")
        if self.target_threads is not None and (
                isinstance(self.target_threads, bool) or self.target_threads < 1):
            raise ValueError(f"target-threads must be >= 1, got {self.target_threads!r}")


def generate_args(config: DefaultPathConfig, drafter: str | None = None):
    """``specd generate`` arguments as a user gives them: only the token budget (and
    ``--model``, ``--target-threads``, ``--drafter`` when set); every other flag its default."""
    from .cli import build_parser

    argv = ["generate", "PROMPT", "--max-new-tokens", str(config.max_new_tokens), "--json"]
    if config.model is not None:
        argv += ["--model", config.model]
    if config.target_threads is not None:
        argv += ["--target-threads", str(config.target_threads)]
    if drafter is not None:
        argv += ["--drafter", drafter]
    return build_parser().parse_args(argv)


def _user_request(args, prompt: Prompt):
    """The request ``specd generate`` sends for ``args`` with ``prompt``'s chat turns (one
    user turn for the shipped code_edit and open_question prompts: exactly what
    ``specd generate "TEXT"`` sends)."""
    from .cli import sampling_from_args
    from .client import generate_request

    request = generate_request(args, sampling_from_args(args))
    del request.chat.messages[:]
    for m in prompt.messages:
        request.chat.messages.add(role=m["role"], content=m["content"])
    return request


class UserPathSystem:
    """One ``specd generate`` request through the embedded service, timed as the CLI times
    it: from sending the request to the final chunk (prefill included)."""

    kind = "service"

    def __init__(self, name: str, address: str, args):
        self.name = name
        self.address = address
        self.args = args

    def generate(self, prompt: Prompt, max_new_tokens: int):
        from .bench import RunRecord
        from .client import stream_generate

        request = _user_request(self.args, prompt)
        request.max_new_tokens = max_new_tokens
        tokens: list[int] = []
        first = None
        final = None
        start = time.perf_counter()
        for chunk in stream_generate(self.address, request):
            if chunk.token_ids and first is None:
                first = time.perf_counter() - start
            tokens.extend(chunk.token_ids)
            if chunk.finish_reason:
                final = chunk
        seconds = time.perf_counter() - start
        if final is None:
            raise RuntimeError(f"{self.name}: the stream ended without a final chunk")
        spec = final.speculation
        return RunRecord(
            system=self.name, workload="", prompt_id="", repeat=-1,
            prompt_tokens=final.usage.prompt_tokens, tokens=tokens, seconds=seconds,
            first_token_seconds=first if first is not None else seconds,
            forward_calls=spec.forward_calls, verification_steps=spec.verification_steps,
            drafted_tokens=spec.drafted_tokens, accepted_tokens=spec.accepted_tokens,
            evaluated_at_position=list(spec.evaluated_at_position),
            accepted_at_position=list(spec.accepted_at_position))


class _HFPromptSystem:
    """A `specd_tools.bench.HFSystem` fed the prompt's token ids through the chat template."""

    kind = "hf"

    def __init__(self, system, tokenizer):
        self.system = system
        self.name = system.name
        self.tokenizer = tokenizer

    def generate(self, prompt: Prompt, max_new_tokens: int):
        from .workloads import encode_prompt

        return self.system.generate(encode_prompt(self.tokenizer, prompt), max_new_tokens)


def _start_embedded(service_config):
    from coordinator.service import Service

    service = Service(service_config)
    return service.start(), service.stop


def run_default_path_bench(config: DefaultPathConfig, progress=print,
                           workloads: list[Workload] | None = None,
                           start_service=None) -> dict:
    """The default user path against transformers, in one run.

    First the forward timing (specd's forward against transformers' per k, this process,
    before any service runs) and the thread check. Then the embedded service that
    ``specd generate`` starts (`specd_tools.cli.embedded_service_config` of the parsed
    default arguments: prompt lookup, adaptive draft length, the default target threads) is
    started ONCE, and every
    prompt is sent to it as ``specd generate`` sends it, timed end to end from the request
    to the final chunk (prefill, gRPC and Ray included; the one-off service start and
    model load excluded, as the CLI's ``tok/s`` excludes them). A subprocess per request
    would time Ray's start and the model load (~10 s) instead of generation. Systems,
    interleaved per prompt and repeat in rotated order:

    - ``specd-generate``: the default request (speculation on);
    - ``specd-generate-drafter-none``: the request ``specd generate --drafter none`` sends
      (speculation off), to the same service;
    - ``hf-plain`` and ``hf-prompt-lookup-k<N>``: transformers ``generate`` in this process,
      greedy, same token budget and EOS, torch's default threads.

    Args:
        workloads: instead of ``config.workloads`` (short prompts for a tiny model).
        start_service: ``f(ServiceConfig) -> (address, stop)`` (tests: an in-process
            service); default starts `coordinator.service.Service`.

    Returns:
        The JSON-ready report: ``mode`` ("default-path"), ``config``, ``environment``,
        ``service`` (its configuration), ``forward``, ``threads`` (`thread_timing`),
        ``systems``, ``summary``
        (`specd_tools.bench.aggregate` with ``ratio_to_plain`` against hf-plain),
        ``identity`` (against hf-plain's first run of each prompt), ``prompt_tokens``
        (whether the service saw the same prompt length as transformers), ``runs``.

    Raises:
        ValueError: a bad configuration, or a model transformers cannot load.
    """
    from dataclasses import asdict as as_dict

    from coordinator.config import default_target_threads
    from target_worker import load_model

    from .bench import (
        HF_PLAIN,
        HFSystem,
        _environment,
        aggregate,
        check_identity,
        load_hf_model,
        reported_forward_timing,
        thread_timing,
    )
    from .cli import embedded_service_config
    from .workloads import encode_prompt

    if workloads is None:
        workloads = load_workloads(list(config.workloads) if config.workloads else None)
    progress(f"loading {config.model or 'the default model (SmolLM2-135M-Instruct)'} "
             "and its transformers twin")
    decoder, tokenizer = load_model(config.model)
    hf_model = load_hf_model(config.model, decoder)
    if hf_model is None:
        raise ValueError(f"transformers cannot load {config.model!r}: --default-path compares "
                         "against it")
    eos = tokenizer.eos_token_id
    forward = None
    if config.forward_ks:
        forward = reported_forward_timing(decoder, hf_model, config, progress)
    threads_rows = None
    if config.thread_check:
        progress("timing specd's forward at 1 and 2 threads, quiet and beside a busy process")
        threads_rows = thread_timing(decoder)
        for row in threads_rows:
            progress(f"busy={row['busy']} k={row['k']} threads={row['threads']}: "
                     f"{row['median_ms']:.1f} ms (max {row['max_ms']:.0f})")
    del decoder  # the service loads its own

    args = generate_args(config)
    service_config = embedded_service_config(args)
    threads = service_config.target_threads or default_target_threads(
        service_config.target_replicas, service_config.tp)
    progress(f"starting the embedded service `specd generate` starts (target threads "
             f"{threads})")
    address, stop = (start_service or _start_embedded)(service_config)
    runs = []
    try:
        systems = [
            UserPathSystem(SPECD_GENERATE, address, args),
            UserPathSystem(SPECD_GENERATE_PLAIN, address, generate_args(config, "none")),
            _HFPromptSystem(HFSystem(HF_PLAIN, hf_model, eos), tokenizer),
            _HFPromptSystem(HFSystem(f"hf-prompt-lookup-k{config.prompt_lookup}", hf_model,
                                     eos, prompt_lookup=config.prompt_lookup), tokenizer),
        ]
        first = workloads[0].prompts[0]
        for system in systems:  # warm-up, untimed
            system.generate(first, min(4, config.max_new_tokens))
        prompts = [(w, p) for w in workloads for p in w.prompts]
        total = config.repeats * len(prompts) * len(systems)
        start = time.perf_counter()
        for repeat in range(config.repeats):
            for index, (w, p) in enumerate(prompts):
                shift = (repeat + index) % len(systems)
                for system in systems[shift:] + systems[:shift]:
                    record = system.generate(p, config.max_new_tokens)
                    record.workload, record.prompt_id, record.repeat = w.name, p.id, repeat
                    runs.append(record)
                    progress(f"[{len(runs)}/{total} {time.perf_counter() - start:.0f}s] "
                             f"{w.name}/{p.id} r{repeat} {system.name}: "
                             f"{len(record.tokens)} tokens, "
                             f"{len(record.tokens) / record.seconds:.1f} tok/s, "
                             f"{record.forward_calls} forwards")
    finally:
        stop()
    names = [s.name for s in systems]
    lengths = {(w.name, p.id): len(encode_prompt(tokenizer, p))
               for w in workloads for p in w.prompts}
    differ = sorted({f"{r.workload}/{r.prompt_id}" for r in runs
                     if r.prompt_tokens != lengths[(r.workload, r.prompt_id)]})
    return {
        "mode": "default-path",
        "config": as_dict(config),
        "environment": {**_environment(), "target_threads": threads},
        "service": as_dict(service_config),
        "forward": forward,
        "threads": threads_rows,
        "workloads": [{"workload": w, "prompt_id": pid, "prompt_tokens": n}
                      for (w, pid), n in lengths.items()],
        "systems": [{"name": s.name, "kind": s.kind} for s in systems],
        "summary": aggregate(runs, names, [w.name for w in workloads], baseline=HF_PLAIN),
        "identity": check_identity(runs, reference_system=HF_PLAIN),
        "prompt_tokens": {"identical": not differ, "differ": differ},
        "runs": [as_dict(r) for r in runs],
    }
