"""What one target step takes and returns: the items of a batched prefill or verify call and
their outputs (the types the coordinator, the target engine and its Ray actor share)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .rule import GreedyRows, ProbRows, SparseProbRows
from .sampling import SamplingParams

__all__ = ["PrefillItem", "StepOutput", "VerifyItem"]


@dataclass(frozen=True)
class PrefillItem:
    """Start a request in ``slot``: feed ``tokens`` (the prompt, non-empty) at ``start_pos``
    (0 for a fresh request; the slot's length to continue the context it holds, as
    `SpeculativeOptions.start_pos`).

    ``want_hidden`` asks for the target's final hidden rows of every prompt position (for a
    drafter that conditions on them).
    """

    slot: int
    tokens: list[int]
    sampling: SamplingParams
    want_hidden: bool = False
    start_pos: int = 0


@dataclass(frozen=True)
class VerifyItem:
    """One verification step of the request in ``slot``.

    ``tokens`` is ``[anchor, *draft]`` (`DecodeRequest.verify_tokens`); ``start_pos`` is the
    request's committed KV length (`DecodeRequest.cache_len`), where the anchor is fed. The
    slot is rolled back to ``start_pos`` first, which discards the rejected positions of the
    previous step.
    """

    slot: int
    start_pos: int
    tokens: list[int]
    sampling: SamplingParams
    want_hidden: bool = False


@dataclass(frozen=True)
class StepOutput:
    """The target's answer for one item.

    Attributes:
        rows: what the rule needs per fed position (`specd_core.rule.target_rows`, compacted
            by `compact_rows`): 1 row for a prefill (its last prompt position), ``len(tokens)``
            rows for a verification.
        hidden: float32 ``[n, hidden_size]`` final hidden rows of every fed position (all
            prompt rows for a prefill), or None unless the item asked for them.
    """

    rows: GreedyRows | ProbRows | SparseProbRows
    hidden: torch.Tensor | None
