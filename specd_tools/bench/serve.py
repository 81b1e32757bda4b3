"""`specd bench serve`: a load generator for any OpenAI-compatible server (specd's HTTP API,
``transformers serve``, vLLM, llama.cpp's server), with the results named as ``vllm bench serve``
names them so the tooling that reads those reads these.

Requests are streamed chat completions (the official ``openai`` async client), sent at Poisson
(or gamma, ``--burstiness``) arrivals of ``--request-rate`` per second, all at once by default,
optionally capped at ``--max-concurrency`` in flight. Per request the client records the time to
the first content chunk (TTFT), the gaps between content chunks (ITL), the end-to-end latency
(E2EL) and the token counts the server reports in ``usage``; `compute_metrics` turns those into
the run's metrics. ``--compare`` (`specd_tools.bench.serve_compare`) runs the same workload
against ``specd serve`` and a peer server in turn.

Definitions (per request; the run's mean/median/std/p90/p99 are over completed requests):

- TTFT: from sending the request to the first chunk with non-empty content.
- TPOT: ``(E2EL - TTFT) / (output tokens - 1)``: the time per output token after the first
  (requests with one output token have none).
- ITL: each gap between consecutive content chunks. A speculative server sends every token a
  verification step accepts in one chunk, so one gap covers several tokens: its ITL is the time
  per *step*, TPOT the time per *token*; they are equal only for one token per chunk.
- E2EL: from sending the request to the end of the stream.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from .serve_data import (
    DATASETS,
    BenchPrompt,
    json_schema_prompts,
    load_bench_tokenizer,
    load_custom,
    load_mt_bench,
    random_prompts,
    sample_prompts,
    structured_prompts,
    tokenizer_source_for,
)

#: Latency metrics, in the order `vllm bench serve` prints them.
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
#: Percentiles reported beside mean, median and std (`p90_ttft_ms`, `p99_ttft_ms`, ...).
PERCENTILES = (90, 99)
#: `--goodput` keys: the latency metrics an SLO may bound.
GOODPUT_KEYS = ("ttft", "tpot", "e2el")


@dataclass
class RequestOutcome:
    """One request as the client saw it. Times are seconds.

    Attributes:
        success: the stream ended normally. error: why not ("" on success).
        prompt_len, output_len: input and output tokens (``token_source`` says from where).
        ttft: time to the first content chunk (the whole latency if none came).
        itl: gaps between consecutive content chunks.
        latency: end-to-end, to the end of the stream.
        text: the generated text. category: the prompt's category or None.
        start: when it was sent, from the run's start. chunks: content chunks received.
        token_source: "usage" (the server's), "tokenizer" (client-side count of the text) or
            "chunks" (one per content chunk: a lower bound, for servers without either).
        schema_valid: a constrained request's answer parsed as JSON and matched its schema
            (`jsonschema` when installed, else parsing only); None when unconstrained or
            not finished ("length").
        speculation: the ``speculation`` counters a specd server sends on the finish chunk
            (`coordinator.front.gateway.speculation_counters`); None from other servers.
    """

    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    text: str = ""
    speculation: dict | None = None
    category: str | None = None
    start: float = 0.0
    chunks: int = 0
    token_source: str = "usage"
    schema_valid: bool | None = None

    @property
    def tpot(self) -> float | None:
        """``(latency - ttft) / (output_len - 1)`` in seconds; None for < 2 output tokens."""
        if self.output_len < 2:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)


def chunk_timing(start: float, chunk_times: Sequence[float], end: float
                 ) -> tuple[float, list[float], float]:
    """``(ttft, itl, latency)`` of one stream from when it was sent (``start``), when each
    content chunk arrived (``chunk_times``, ascending) and when the stream ended (``end``), all
    on one clock in seconds. With no content chunk, TTFT is the whole latency."""
    latency = end - start
    if not chunk_times:
        return latency, [], latency
    itl = [b - a for a, b in zip(chunk_times, chunk_times[1:], strict=False)]
    return chunk_times[0] - start, itl, latency


def _stats(name: str, values_s: Sequence[float]) -> dict[str, float]:
    """``mean_/median_/std_/p90_/p99_<name>_ms`` of ``values_s`` (seconds), in ms; all 0.0
    when empty (as vLLM reports them). std is the population standard deviation; the
    percentiles interpolate linearly (``numpy.percentile``'s default, as vLLM)."""
    import numpy as np

    ms = np.asarray(values_s, dtype=float) * 1000.0
    out = {
        f"mean_{name}_ms": float(ms.mean()) if ms.size else 0.0,
        f"median_{name}_ms": float(np.median(ms)) if ms.size else 0.0,
        f"std_{name}_ms": float(ms.std()) if ms.size else 0.0,
    }
    for p in PERCENTILES:
        out[f"p{p}_{name}_ms"] = float(np.percentile(ms, p)) if ms.size else 0.0
    return out


def compute_metrics(outcomes: Sequence[RequestOutcome], duration: float,
                    goodput: dict[str, float] | None = None) -> dict[str, Any]:
    """The run's metrics, keyed as ``vllm bench serve`` keys them.

    Args:
        outcomes: every request of the run (failed ones count only in ``failed``).
        duration: seconds from the first request sent to the last one finished (> 0).
        goodput: SLOs in ms by `GOODPUT_KEYS` name; a completed request is good when it meets
            every one given (a request with < 2 output tokens has TPOT 0, as in vLLM). Adds
            ``request_goodput`` (good requests per second).

    Returns:
        ``completed``, ``failed``, ``duration`` (s), ``total_input_tokens``,
        ``total_output_tokens``, ``request_throughput`` (req/s), [``request_goodput``],
        ``output_throughput`` and ``total_token_throughput`` (tok/s), then
        ``mean_/median_/std_/p90_/p99_`` of ``ttft_ms``, ``tpot_ms``, ``itl_ms``, ``e2el_ms``.
    """
    done = [o for o in outcomes if o.success]
    total_in = sum(o.prompt_len for o in done)
    total_out = sum(o.output_len for o in done)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda _x: 0.0)
    metrics: dict[str, Any] = {
        "completed": len(done),
        "failed": len(outcomes) - len(done),
        "duration": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": per_s(len(done)),
    }
    if goodput:
        good = sum(1 for o in done if meets_slos(o, goodput))
        metrics["request_goodput"] = per_s(good)
    counted = [o.speculation for o in done if o.speculation is not None]
    if counted:  # a specd server: its own counters, summed over the requests
        steps = sum(c.get("verification_steps", 0) for c in counted)
        tokens = sum(c.get("acceptance_length", 0.0) * c.get("verification_steps", 0)
                     for c in counted)  # tokens committed by verification steps
        metrics["forward_calls"] = sum(c.get("forward_calls", 0) for c in counted)
        metrics["drafted_tokens"] = sum(c.get("drafted_tokens", 0) for c in counted)
        metrics["accepted_tokens"] = sum(c.get("accepted_tokens", 0) for c in counted)
        metrics["acceptance_length"] = tokens / steps if steps else None
    checked = [o.schema_valid for o in done if o.schema_valid is not None]
    if checked:  # a constrained workload: how many finished answers matched their schema
        metrics["schema_checked"], metrics["schema_valid"] = len(checked), sum(checked)
    metrics["output_throughput"] = per_s(total_out)
    metrics["total_token_throughput"] = per_s(total_in + total_out)
    metrics.update(_stats("ttft", [o.ttft for o in done]))
    metrics.update(_stats("tpot", [o.tpot for o in done if o.tpot is not None]))
    metrics.update(_stats("itl", [gap for o in done for gap in o.itl]))
    metrics.update(_stats("e2el", [o.latency for o in done]))
    return metrics


def meets_slos(outcome: RequestOutcome, slos_ms: dict[str, float]) -> bool:
    """Whether a completed request meets every SLO (ms) in ``slos_ms`` (`GOODPUT_KEYS`)."""
    values = {"ttft": outcome.ttft, "tpot": outcome.tpot or 0.0, "e2el": outcome.latency}
    return all(values[k] * 1000.0 <= limit for k, limit in slos_ms.items())


def category_metrics(outcomes: Sequence[RequestOutcome], duration: float,
                     goodput: dict[str, float] | None = None) -> dict[str, dict[str, Any]]:
    """`compute_metrics` per prompt category (sorted), over the run's ``duration``: the
    throughputs are each category's share of the run's. Empty when no prompt has one."""
    names = sorted({o.category for o in outcomes if o.category is not None})
    return {c: compute_metrics([o for o in outcomes if o.category == c], duration, goodput)
            for c in names}


# ---------------------------------------------------------------------------- the workload


@dataclass
class ServeBenchConfig:
    """One `specd bench serve` workload (the flags of the same names).

    ``rates`` in requests/s (``math.inf``: all at once); ``concurrencies``: the most requests
    in flight (None: no cap); every rate runs at every concurrency (`load_points`).
    ``goodput`` SLOs in ms; ``request_timeout`` in seconds per request."""

    base_url: str = ""
    model: str | None = None
    api_key: str | None = None
    dataset_name: str = "mt-bench"
    dataset_path: str | None = None
    num_prompts: int | None = None
    input_len: int = 128
    output_len: int = 128
    seed: int = 0
    rates: tuple[float, ...] = (math.inf,)
    burstiness: float = 1.0
    concurrencies: tuple[int | None, ...] = (None,)
    temperature: float = 0.0
    ignore_eos: bool = False
    extra_body: dict = field(default_factory=dict)
    goodput: dict[str, float] = field(default_factory=dict)
    tokenizer: str | None = None
    warmup: int = 1
    request_timeout: float = 600.0
    progress_bar: bool = True


def load_workload(cfg: ServeBenchConfig, tokenizer: Any = None) -> list[BenchPrompt]:
    """The prompts ``cfg`` names (`specd_tools.bench.serve_data`), ``num_prompts`` of them.

    Raises:
        ValueError: bad dataset flags or file (names the flag, and the line and field).
    """
    if cfg.dataset_name not in DATASETS:
        raise ValueError(f"--dataset-name must be one of {', '.join(DATASETS)}, "
                         f"got {cfg.dataset_name!r}")
    if cfg.dataset_name == "custom":
        if not cfg.dataset_path:
            raise ValueError("--dataset-path FILE is required with --dataset-name custom")
        return sample_prompts(load_custom(cfg.dataset_path), cfg.num_prompts, cfg.seed)
    if cfg.dataset_path:
        raise ValueError(f"--dataset-path is only read with --dataset-name custom, not "
                         f"{cfg.dataset_name}")
    if cfg.dataset_name == "mt-bench":
        return sample_prompts(load_mt_bench(), cfg.num_prompts, cfg.seed)
    num = cfg.num_prompts if cfg.num_prompts is not None else RANDOM_NUM_PROMPTS
    if num < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num}")
    if cfg.dataset_name == "structured":
        return structured_prompts(num, cfg.seed)
    if cfg.dataset_name == "json-schema":
        return json_schema_prompts(num, cfg.seed)
    return random_prompts(num, cfg.input_len, cfg.seed, tokenizer)


#: `--dataset-name random`'s and `structured`'s default `--num-prompts`.
RANDOM_NUM_PROMPTS = 100


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """When each of ``n`` requests is sent, in seconds from the run's start: the first at 0,
    then gaps drawn from a gamma distribution with shape ``burstiness`` and mean ``1 / rate``
    (``burstiness`` 1: a Poisson process; < 1 burstier, > 1 more regular). All 0 for an
    infinite rate."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        if i:
            t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        out.append(t)
    return out


def openai_client(base_url: str, api_key: str | None, timeout: float):
    """An ``openai.AsyncOpenAI`` for ``base_url`` (no retries: a failure is a result).

    Raises:
        ValueError: the ``openai`` package is missing (names the extra to install).
    """
    try:
        import openai
    except ImportError:
        raise ValueError("specd bench serve needs the openai client: "
                         "pip install 'specd[bench]'") from None
    return openai.AsyncOpenAI(base_url=base_url, api_key=api_key or "EMPTY", max_retries=0,
                              timeout=timeout)


async def first_model(client, base_url: str) -> str:
    """The first model id the server lists at ``/v1/models``.

    Raises:
        RuntimeError: the server does not answer or lists none (names ``--base-url``).
    """
    import openai

    try:
        page = await client.models.list()
    except openai.AuthenticationError as exc:  # 401: no key, or not one it takes
        raise RuntimeError(f"--base-url {base_url}: GET /models was refused (401: {exc}); "
                           "pass the server's key with --api-key or $OPENAI_API_KEY "
                           "(specd serve's --auth-token)") from None
    except openai.APIError as exc:
        raise RuntimeError(f"--base-url {base_url}: GET /models failed ({exc}); is the server "
                           f"up, and is the URL its .../v1?") from None
    ids = [m.id for m in page.data]
    if not ids:
        raise RuntimeError(f"--base-url {base_url}: /models lists no model; give --model")
    return ids[0]


async def send_request(client, model: str, prompt: BenchPrompt, cfg: ServeBenchConfig,
                       tokenizer: Any = None, run_start: float = 0.0) -> RequestOutcome:
    """Streams one chat completion and times it (`chunk_timing`); never raises for a failed
    request: the outcome says why (``success`` False, ``error``)."""
    out = RequestOutcome(category=prompt.category)
    extra = {**cfg.extra_body, **({"ignore_eos": True} if cfg.ignore_eos else {})} or None
    constrained = {} if prompt.schema is None else {"response_format": {
        "type": "json_schema",
        "json_schema": {"name": prompt.category or "answer", "schema": prompt.schema,
                        "strict": True}}}
    finish = None
    chunk_times: list[float] = []
    parts: list[str] = []
    usage = None
    start = time.perf_counter()
    out.start = start - run_start
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt.prompt}],
            max_tokens=cfg.output_len, temperature=cfg.temperature, stream=True,
            stream_options={"include_usage": True}, extra_body=extra, **constrained)
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                usage = chunk.usage
            counters = (chunk.model_extra or {}).get("speculation")
            if isinstance(counters, dict):
                out.speculation = counters
            for choice in chunk.choices or ():
                finish = choice.finish_reason or finish
                text = choice.delta.content if choice.delta is not None else None
                if text:
                    chunk_times.append(now)
                    parts.append(text)
        end = time.perf_counter()
    except Exception as exc:  # noqa: BLE001 - any failure is this request's result
        out.latency = time.perf_counter() - start
        out.error = f"{type(exc).__name__}: {exc}"
        return out
    out.ttft, out.itl, out.latency = chunk_timing(start, chunk_times, end)
    out.text, out.chunks, out.success = "".join(parts), len(chunk_times), True
    if prompt.schema is not None and finish == "stop":
        out.schema_valid = schema_valid(out.text, prompt.schema)
    if usage is not None and usage.completion_tokens is not None:
        out.output_len, out.prompt_len = usage.completion_tokens, usage.prompt_tokens or 0
    elif tokenizer is not None:
        out.token_source = "tokenizer"
        out.output_len = len(tokenizer.encode(out.text, add_special_tokens=False))
        out.prompt_len = prompt.prompt_len or len(
            tokenizer.encode(prompt.prompt, add_special_tokens=False))
    else:
        out.token_source = "chunks"
        out.output_len, out.prompt_len = out.chunks, prompt.prompt_len or 0
    return out


def schema_valid(text: str, schema: dict) -> bool:
    """Whether ``text`` is JSON matching ``schema`` (parsing only without `jsonschema`)."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    try:
        import jsonschema
    except ImportError:
        return True
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return False
    return True


def load_points(cfg: ServeBenchConfig) -> list[tuple[float, int | None]]:
    """The runs' ``(rate, max concurrency)``: each concurrency, each rate within it."""
    return [(rate, c) for c in cfg.concurrencies for rate in cfg.rates]


async def run_load(client, model: str, prompts: Sequence[BenchPrompt], cfg: ServeBenchConfig,
                   rate: float, concurrency: int | None = None, tokenizer: Any = None,
                   desc: str = "requests") -> tuple[list[RequestOutcome], float]:
    """Sends ``prompts`` at ``rate`` (`arrival_offsets`), at most ``concurrency`` in flight
    (None: no cap), with a progress bar; returns the outcomes (in prompt order) and the
    duration in seconds (first request sent to last finished)."""
    from tqdm import tqdm

    offsets = arrival_offsets(len(prompts), rate, cfg.burstiness, cfg.seed)
    limit = asyncio.Semaphore(concurrency) if concurrency else None
    bar = tqdm(total=len(prompts), desc=desc, unit="req", file=sys.stderr, leave=False,
               disable=None if cfg.progress_bar else True)
    start = time.perf_counter()

    async def one(prompt: BenchPrompt, offset: float) -> RequestOutcome:
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if limit is None:
            result = await send_request(client, model, prompt, cfg, tokenizer, start)
        else:
            async with limit:
                result = await send_request(client, model, prompt, cfg, tokenizer, start)
        bar.update(1)
        return result

    try:
        outcomes = await asyncio.gather(*(one(p, o) for p, o in zip(prompts, offsets,
                                                                    strict=True)))
    finally:
        bar.close()
    return list(outcomes), time.perf_counter() - start


#: The warm-up requests' prompts, in turn: in no dataset, so a server that keeps state across
#: requests (specd's suffix-decoding cache, any prefix cache) has not seen a measured prompt's
#: answer before it is measured.
WARMUP_PROMPTS = (
    "Name three colours of the rainbow.",
    "Count from one to five in words.",
    "What is the capital of France? Answer in one sentence.",
)


async def warm_up(client, model: str, prompts: Sequence[BenchPrompt], cfg: ServeBenchConfig,
                  tokenizer: Any = None) -> list[RequestOutcome]:
    """``cfg.warmup`` requests one after another (not counted) with `WARMUP_PROMPTS` in turn,
    none of them a measured prompt (``prompts`` is not sent); the first also checks the
    endpoint works.

    Raises:
        RuntimeError: a warm-up request failed (with the server's error).
    """
    outcomes = []
    for i in range(cfg.warmup):
        warm = BenchPrompt(WARMUP_PROMPTS[i % len(WARMUP_PROMPTS)])
        outcome = await send_request(client, model, warm, cfg, tokenizer)
        if not outcome.success:
            raise RuntimeError(f"the warm-up request to {cfg.base_url} (model {model!r}) "
                               f"failed: {outcome.error}")
        outcomes.append(outcome)
    return outcomes


def run_record(label: str, rate: float, concurrency: int | None, cfg: ServeBenchConfig,
               model: str, outcomes: Sequence[RequestOutcome], duration: float
               ) -> dict[str, Any]:
    """One run's JSON object: the settings and metrics under vLLM's names, per category, and
    the per-request lists vLLM writes (``input_lens``, ``output_lens``, ``ttfts``, ``itls``
    in seconds, ``generated_texts``, ``errors``) plus ``categories``, ``tpots`` (s, None
    for < 2 tokens), ``e2els`` and ``start_times`` (s, when each was sent from the run's
    start) and ``token_sources``."""
    record: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "openai-chat",
        "label": label,
        "base_url": cfg.base_url,
        "model_id": model,
        "tokenizer_id": cfg.tokenizer,
        "dataset_name": cfg.dataset_name,
        "num_prompts": len(outcomes),
        "request_rate": "inf" if math.isinf(rate) else rate,
        "burstiness": cfg.burstiness,
        "max_concurrency": concurrency,
        "output_len": cfg.output_len,
        "temperature": cfg.temperature,
        "ignore_eos": cfg.ignore_eos,
        "extra_body": cfg.extra_body or None,
        "goodput_slos_ms": cfg.goodput or None,
    }
    record.update(compute_metrics(outcomes, duration, cfg.goodput))
    record["per_category"] = category_metrics(outcomes, duration, cfg.goodput)
    record.update({
        "input_lens": [o.prompt_len for o in outcomes],
        "output_lens": [o.output_len for o in outcomes],
        "ttfts": [o.ttft for o in outcomes],
        "tpots": [o.tpot for o in outcomes],
        "itls": [o.itl for o in outcomes],
        "e2els": [o.latency for o in outcomes],
        "start_times": [o.start for o in outcomes],
        "generated_texts": [o.text for o in outcomes],
        "errors": [o.error for o in outcomes],
        "categories": [o.category for o in outcomes],
        "token_sources": [o.token_source for o in outcomes],
    })
    return record


def outcomes_of(record: dict[str, Any]) -> list[RequestOutcome]:
    """The `RequestOutcome`s back from a `run_record` (for plots and pooling)."""
    return [RequestOutcome(success=not err, error=err, prompt_len=i, output_len=n, ttft=t,
                           itl=list(g), latency=e, text=x, category=c, token_source=s,
                           start=t0)
            for i, n, t, g, e, x, c, s, err, t0 in zip(
                record["input_lens"], record["output_lens"], record["ttfts"], record["itls"],
                record["e2els"], record["generated_texts"], record["categories"],
                record["token_sources"], record["errors"], record["start_times"],
                strict=True)]


async def bench_endpoint(cfg: ServeBenchConfig, label: str = "server",
                         progress: Callable[[str], None] = lambda _m: None,
                         prompts: Sequence[BenchPrompt] | None = None,
                         tokenizer: Any = None) -> dict[str, Any]:
    """Runs the workload against ``cfg.base_url`` at each rate in turn (after the warm-up).

    Returns:
        ``{"model": id, "warmup_e2el_ms": [...], "runs": [run_record per rate]}``.

    Raises:
        RuntimeError: the server is unreachable or the warm-up fails. ValueError: bad flags.
    """
    client = openai_client(cfg.base_url, cfg.api_key, cfg.request_timeout)
    try:
        model = cfg.model or await first_model(client, cfg.base_url)
        if tokenizer is None and prompts is None:
            tokenizer = resolve_tokenizer(cfg, model, progress)
        if prompts is None:
            prompts = load_workload(cfg, tokenizer)
        warm = await warm_up(client, model, prompts, cfg, tokenizer)
        runs = []
        for rate, concurrency in load_points(cfg):
            shown = "inf" if math.isinf(rate) else f"{rate:g}"
            progress(f"{label}: {len(prompts)} requests at rate {shown}/s"
                     + (f", at most {concurrency} in flight" if concurrency else ""))
            outcomes, duration = await run_load(
                client, model, prompts, cfg, rate, concurrency, tokenizer,
                desc=f"{label} rate={shown}" + (f" c={concurrency}" if concurrency else ""))
            runs.append(run_record(label, rate, concurrency, cfg, model, outcomes, duration))
    finally:
        await client.close()
    return {"model": model, "warmup_e2el_ms": [o.latency * 1000 for o in warm], "runs": runs}


def resolve_tokenizer(cfg: ServeBenchConfig, model: str,
                      progress: Callable[[str], None] = lambda _m: None) -> Any:
    """``--tokenizer``, else the served model when its id names a local model (a directory,
    a .gguf or a tiny-random spec), else None (see the README for what changes without one).

    Raises:
        ValueError: ``--tokenizer`` does not load.
    """
    source = cfg.tokenizer or tokenizer_source_for(model)
    if source is None:
        return None
    progress(f"tokenizer: {source}")
    cfg.tokenizer = source
    return load_bench_tokenizer(source)
