"""What one replica step computes: the scheduling decision, apart from its execution.

Chunked prefill under one per-step token budget, after vLLM v1's scheduler (decodes first,
then prefill chunks within ``max_num_batched_tokens``) and Sarathi-Serve (Agrawal et al.,
OSDI'24): every request decoding verifies its block, and prompts waiting to be computed get
chunks of what is left of the budget, so a long prompt advances chunk by chunk across steps
while the others keep decoding. At most ``max_partial_prefills`` prompts are left half-done at
once (vLLM PR #41399's cap), so a burst of long prompts does not hold every new request's
first token back.

Pure: no Ray, no sockets, no model; `coordinator.step.scheduler.Scheduler` executes the plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["DEFAULT_MAX_BATCHED_TOKENS", "ChunkPolicy", "plan_prefill_chunks"]

#: The service's per-step token budget (``--max-batched-tokens``): see the README's "Long
#: prompts" for the measured trade between a long prompt's own time to first token and the
#: other streams' inter-token latency on a 2-core CPU (SmolLM2, one target thread: 128 keeps
#: a short stream's longest gap under a second beside a 6,500-token prompt, 256 does not).
DEFAULT_MAX_BATCHED_TOKENS = 128

#: A step that verifies nothing (no request is decoding, so no stream can stall) feeds this
#: many budgets of prompt chunks: fewer, bigger steps (each reads every weight once). Measured
#: here (SmolLM2, a 3k-token prompt alone): TTFT 4.5 s in 256-token chunks against ~3.6 s whole.
IDLE_BUDGET_FACTOR = 4


@dataclass(frozen=True)
class ChunkPolicy:
    """How a replica step shares its forward between verify blocks and prefill chunks.

    Attributes:
        max_batched_tokens: tokens one step feeds at most (vLLM's
            ``max_num_batched_tokens``), or None: every prompt is computed whole in the
            step after its admission (no chunking). Verify blocks always go; prefill chunks
            get the rest, and never less than a quarter of it, so admissions make progress
            however many requests decode; a step that verifies nothing feeds
            `IDLE_BUDGET_FACTOR` budgets of chunks.
        max_partial_prefills: prompts that may be left partly computed at the end of a step
            (vLLM's ``max_num_partial_prefills``); a prompt whose rest fits this step always
            goes.

    Raises:
        ValueError: ``max_batched_tokens`` < 1 or ``max_partial_prefills`` < 1 (naming it).
    """

    max_batched_tokens: int | None = None
    max_partial_prefills: int = 1

    def __post_init__(self) -> None:
        for name in ("max_batched_tokens", "max_partial_prefills"):
            value = getattr(self, name)
            if value is None and name == "max_batched_tokens":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")

    def prefill_budget(self, verify_tokens: int) -> int | None:
        """Tokens left for prefill chunks in a step that verifies ``verify_tokens``; None:
        unlimited (no chunking)."""
        if self.max_batched_tokens is None:
            return None
        if not verify_tokens:
            return IDLE_BUDGET_FACTOR * self.max_batched_tokens
        return max(self.max_batched_tokens - verify_tokens, self.max_batched_tokens // 4, 1)


def plan_prefill_chunks(remaining: Sequence[int], started: Sequence[bool], verify_tokens: int,
                        policy: ChunkPolicy) -> list[int]:
    """How many prompt tokens each prefilling request computes this step.

    Shortest remaining prompt first (ties: the order given, i.e. admission order), so short
    prompts get their first token without waiting behind a long one; a prompt that cannot
    finish this step takes a chunk only while fewer than ``policy.max_partial_prefills``
    prompts would be left partly computed (one already started always may continue).

    Args:
        remaining: per prefilling request, prompt tokens not yet computed (each >= 1).
        started: per request, whether earlier steps computed part of its prompt.
        verify_tokens: tokens this step's verify blocks feed (anchors and drafts).
        policy: the budget and the cap.

    Returns:
        Per request, in the order given, the chunk length (0: nothing this step). The
        chunks sum to at most ``policy.prefill_budget(verify_tokens)``.

    Raises:
        ValueError: ``remaining`` and ``started`` differ in length, or a ``remaining`` < 1.
    """
    if len(remaining) != len(started):
        raise ValueError(f"remaining has {len(remaining)} entries, started {len(started)}")
    if any(r < 1 for r in remaining):
        raise ValueError(f"every remaining count must be >= 1, got {list(remaining)}")
    left = policy.prefill_budget(verify_tokens)
    if left is None:
        return list(remaining)
    chunks = [0] * len(remaining)
    partial = sum(map(bool, started))
    for i in sorted(range(len(remaining)), key=lambda j: remaining[j]):
        if left <= 0:
            break
        take = min(remaining[i], left)
        if take == remaining[i]:
            partial -= bool(started[i])
        elif not started[i]:
            if partial >= policy.max_partial_prefills:
                continue
            partial += 1
        chunks[i] = take
        left -= take
    return chunks
