"""The in-process speculative decoding loop (the seed's entry points).

`speculative_decode_with` drives one `specd_core.request.DecodeRequest` against a
`target_worker.Decoder` and any `Drafter` in this process; the service's scheduler drives the
same `DecodeRequest` per request.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from drafter_worker import PromptLookupSpeculator
from specd_core.draft import DraftBlock, Drafter
from specd_core.request import (
    DecodeRequest,
    FinishReason,
    SpeculativeDecodeResult,
    SpeculativeOptions,
    check_context,
)
from specd_core.sampling import draft_sampling

from .adaptive import AdaptiveDraftLength

__all__ = [
    "DecodeRequest",
    "FinishReason",
    "SpeculativeDecodeResult",
    "SpeculativeOptions",
    "check_context",
    "speculative_decode",
    "speculative_decode_with",
]


def speculative_decode_with(
    decoder,
    prompt_tokens: Sequence[int],
    cache,
    drafter: Drafter | None,
    options: SpeculativeOptions,
    on_tokens: Callable[[list[int]], None] | None = None,
    adaptive: AdaptiveDraftLength | None = None,
) -> SpeculativeDecodeResult:
    """Generates up to ``options.max_new_tokens`` tokens with speculative decoding.

    The prompt is one prefill forward; each step verifies anchor + draft in one
    ``decoder.forward_batch_with_hidden`` call. Output is distributed exactly as plain
    token-at-a-time sampling with ``options.sampling`` (token-identical when greedy).

    Args:
        decoder: a `target_worker.Decoder`.
        prompt_tokens: non-empty token ids to append at ``options.start_pos``.
        cache: the decoder's `KvCache`, holding exactly the context before the prompt. On
            return it holds that context + prompt + every generated token except the last.
        drafter: any `Drafter`; ``None`` decodes plainly (one token per forward).
        on_tokens: called with each step's newly committed tokens, in order (streaming).
        adaptive: this request's `AdaptiveDraftLength`; when given, each step drafts at most
            ``adaptive.next_len(...)`` tokens (0: the drafter is not called) and reports
            what was accepted; each forward's time updates ``adaptive.cost_model``. Output
            stays lossless; with a point-mass drafter (prompt lookup) seeded output is
            token-identical with and without it (`specd_core.rule`), with a sampling
            drafter it is identically distributed.

    Raises:
        ValueError: empty prompt, ``start_pos != cache.seq_len``, or prompt +
            ``max_new_tokens`` beyond the model's context.
    """
    if options.start_pos != cache.seq_len:
        raise ValueError(
            f"start_pos must be the cache's current length: start_pos={options.start_pos}, "
            f"cache.seq_len={cache.seq_len}"
        )
    request = DecodeRequest(prompt_tokens, options)
    check_context(decoder.config.max_seq_len, options, request.num_prompt_tokens)
    if request.finished:
        return request.result
    logits, hidden = decoder.forward_batch_with_hidden(
        request.prefill_tokens(), options.start_pos, cache, last_logits_only=True
    )
    # Hidden rows are kept only for a drafter that conditions on them.
    wants_hidden = drafter is not None and getattr(drafter, "wants_hidden", True)
    if drafter is not None and hasattr(drafter, "session"):
        # A drafter with per-request state (its own KV cache) drafts through a fresh session
        # that samples with this request's transforms (honest q at any temperature).
        drafter = drafter.session(draft_sampling(options.sampling),
                                  0 if options.seed is None else options.seed)
    request.on_prefill(request.rows(logits), hidden if wants_hidden else None)
    # The drafter's own cap, where it declares one (prompt lookup's max_draft_len).
    drafter_max = getattr(drafter, "max_draft_len", None) or None
    emitted = 0
    while True:
        if on_tokens is not None and len(request.generated) > emitted:
            on_tokens(request.generated[emitted:])
            emitted = len(request.generated)
        if request.finished:
            break
        budget = request.draft_budget()
        consulted = adaptive is not None and budget > 0 and drafter is not None
        if consulted:
            budget = min(budget, adaptive.next_len(budget, drafter_max))
        draft = DraftBlock.empty()
        if budget > 0 and drafter is not None:
            draft = drafter.propose(tuple(request.history), request.take_hidden(), budget)
            draft.truncate(budget)
        accepted_before = request.result.accepted_tokens
        batch = request.verify_tokens(draft)
        began = time.perf_counter()
        logits, hidden = decoder.forward_batch_with_hidden(batch, request.cache_len, cache)
        if consulted:
            adaptive.cost_model.observe(len(batch), time.perf_counter() - began)
        keep = request.on_verify(draft, request.rows(logits, draft.tokens),
                                 hidden if wants_hidden else None)
        if cache.seq_len > keep:
            cache.truncate(keep)
        if consulted:
            adaptive.update(len(draft), request.result.accepted_tokens - accepted_before)
    return request.result


def speculative_decode(
    decoder,
    prompt_tokens: Sequence[int],
    max_new_tokens: int,
    cache,
    drafter: Drafter | None = None,
) -> SpeculativeDecodeResult:
    """Greedy speculative decode from a fresh cache (prompt lookup, n=3, k=10, by default)."""
    return speculative_decode_with(
        decoder,
        prompt_tokens,
        cache,
        drafter if drafter is not None else PromptLookupSpeculator(3, 10),
        SpeculativeOptions(max_new_tokens=max_new_tokens),
    )
