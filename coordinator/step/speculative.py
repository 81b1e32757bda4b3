"""The in-process entry points (the seed's API) over the service's scheduler.

`speculative_decode_with` runs one request through `coordinator.step.scheduler.Scheduler`, the
loop the service runs, with in-process adapters: the caller's decoder and `KvCache` behind
the `Target` interface (`CacheTarget` over a `target_worker.engine.TargetEngine`) and the
caller's `Drafter` behind the drafter interface (`drafter_worker.local.LocalDrafter`, the
drafter worker's per-request sessions without gRPC). Rollback, target rows, the adaptive
chooser's inputs and the drafter's capabilities are therefore decided in one place for the
service and for this path.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from drafter_worker.local import LocalDrafter
from drafter_worker.prompt_lookup import PromptLookupSpeculator
from drafter_worker.registry import DEFAULT_NGRAM_SIZE, LOOKUP_DRAFT_LEN
from specd_core.draft import Drafter
from specd_core.request import (
    DecodeRequest,
    SpeculativeDecodeResult,
    SpeculativeOptions,
    check_context,
)

from .adaptive import AdaptiveDraftLength
from .scheduler import Scheduler
from .targets import CacheTarget

__all__ = ["speculative_decode", "speculative_decode_with"]


def speculative_decode_with(
    decoder,
    prompt_tokens: Sequence[int],
    cache,
    drafter: Drafter | None,
    options: SpeculativeOptions,
    on_tokens: Callable[[list[int]], None] | None = None,
    adaptive: AdaptiveDraftLength | None = None,
    pipeline: bool | str = False,
    fallback_threads: int | None = None,
) -> SpeculativeDecodeResult:
    """Generates up to ``options.max_new_tokens`` tokens with speculative decoding.

    The prompt is one prefill forward; each step verifies anchor + draft in one target
    forward. Output is distributed exactly as plain token-at-a-time sampling with
    ``options.sampling`` (token-identical when greedy), and equals what the service returns
    for the same request and drafter.

    Args:
        decoder: a `target_worker.Decoder`.
        prompt_tokens: non-empty token ids to append at ``options.start_pos``.
        cache: the decoder's `KvCache`, holding exactly the context before the prompt. On
            return it holds that context + prompt + every generated token except the last.
        drafter: any `Drafter` (its `DrafterCapabilities` say whether it gets hidden rows
            and which: the final-norm rows or the residual streams of its ``hidden_layers``,
            its own cap and whether it keeps per-request sessions; a drafter that declares
            nothing gets the defaults); ``None`` decodes plainly (one token per forward).
        on_tokens: called with each step's newly committed tokens, in order (streaming).
        adaptive: this request's `AdaptiveDraftLength`; when given, each step drafts at most
            what it chooses (0: the drafter is not called) and reports what was accepted;
            each step's time updates ``adaptive.cost_model``. Output stays lossless; with a
            point-mass drafter (prompt lookup) seeded output is token-identical with and
            without it (`specd_core.rule`), with a sampling drafter it is identically
            distributed.
        pipeline: run the service's pipelined drafting schedule (`coordinator.step.scheduler`)
            in process (True), or choose it by measurement (``"auto"``); the drafter runs on
            this thread, so nothing overlaps, but the tokens are the same: this is how the
            losslessness tests reach that code.
        fallback_threads: torch threads a forward runs on instead of the caller's where they
            measure cheaper (None: always the caller's; `TargetEngine`).

    Raises:
        ValueError: empty prompt, ``start_pos != cache.seq_len``, prompt +
            ``max_new_tokens`` beyond the model's context, or a bad ``pipeline``. Any error
            that fails the request inside the loop is raised as it was raised there.
    """
    if options.start_pos != cache.seq_len:
        raise ValueError(
            f"start_pos must be the cache's current length: start_pos={options.start_pos}, "
            f"cache.seq_len={cache.seq_len}"
        )
    check = DecodeRequest(prompt_tokens, options)  # validates the prompt
    check_context(decoder.config.max_seq_len, options, check.num_prompt_tokens)
    if check.finished:
        return check.result
    from target_worker.engine import TargetEngine

    local = None if drafter is None else LocalDrafter(drafter)
    caps = None if local is None else local.capabilities
    scheduler = Scheduler(
        CacheTarget(TargetEngine(decoder, max_slots=1, fallback_threads=fallback_threads), cache),
        local, max_active=1,
        wants_hidden=caps is not None and caps.wants_hidden,
        hidden_layers=() if caps is None else caps.hidden_layers,
        adaptive=adaptive is not None,
        cost_model=None if adaptive is None else adaptive.cost_model,
        drafter_max_len=None if caps is None else caps.max_draft_len,
        hidden_dtype=torch.float32, pipeline=pipeline)
    scheduler.remember_outputs = caps is not None and caps.remembers
    req = scheduler.submit(prompt_tokens, options, adaptive=adaptive)
    result: list[SpeculativeDecodeResult] = []

    def deliver() -> None:
        while not req.events.empty():
            event = req.events.get_nowait()
            if isinstance(event, list):
                if on_tokens is not None:
                    on_tokens(event)
            elif isinstance(event, SpeculativeDecodeResult):
                result.append(event)
            else:
                raise req.cause if req.cause is not None else event

    async def drive() -> None:
        await scheduler.run_until_idle(after_step=deliver)
        await scheduler.settle_drafter()  # the drafter's release runs before the loop closes

    _run(drive())  # each step asks the engine for the drafter's `hidden_layers` rows
    keep = req.decode.cache_len  # the committed length: drop the last step's rejected rows
    if cache.seq_len > keep:
        cache.truncate(keep)
    return result[0]


def _run(coro: Coroutine) -> None:
    """Runs ``coro`` to completion from synchronous code, also when this thread already runs
    an event loop (then on a worker thread)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        asyncio.run(coro)
        return
    with ThreadPoolExecutor(max_workers=1) as pool:
        pool.submit(asyncio.run, coro).result()


def speculative_decode(
    decoder,
    prompt_tokens: Sequence[int],
    max_new_tokens: int,
    cache,
    drafter: Drafter | None = None,
) -> SpeculativeDecodeResult:
    """Greedy speculative decode from a fresh cache (prompt lookup by default: n-gram
    `DEFAULT_NGRAM_SIZE`, `LOOKUP_DRAFT_LEN` tokens)."""
    return speculative_decode_with(
        decoder,
        prompt_tokens,
        cache,
        drafter if drafter is not None else PromptLookupSpeculator(DEFAULT_NGRAM_SIZE,
                                                                   LOOKUP_DRAFT_LEN),
        SpeculativeOptions(max_new_tokens=max_new_tokens),
    )
