"""What one target step takes and returns: the items of a batched target call (verify blocks and
prefill chunks, fed in one packed forward) and their outputs (the types the coordinator, the
target engine and its Ray actor share)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from .logprobs import RowLogprobs
from .rule import GreedyRows, ProbRows, SparseProbRows
from .sampling import SamplingParams

__all__ = ["PrefillItem", "StepOutput", "VerifyItem", "payload_bytes"]


@dataclass(frozen=True)
class PrefillItem:
    """Feed a request's prompt, or one chunk of it, in ``slot``.

    The prompt starts at ``start_pos`` (0 for a fresh request; the slot's length to continue
    the context it holds, as `SpeculativeOptions.start_pos`). ``tokens`` (non-empty) are its
    positions ``[offset, offset + len(tokens))``: ``offset`` 0 starts the prompt (the slot
    keeps its first ``start_pos`` positions and forgets the rest); a later chunk (chunked
    prefill, or a prompt whose first ``offset`` tokens the slot already holds from prefix
    reuse) continues it, and the slot must then hold exactly ``start_pos + offset``
    positions. ``last`` marks the chunk that ends the prompt: only it gets logits (the rows
    for the prompt's last position).

    ``want_hidden`` asks for the target's hidden rows of every position fed (for a drafter
    that conditions on them): the final-norm rows, or with ``hidden_layers`` the residual
    streams entering those layers (see `VerifyItem`).

    Log probabilities (`specd_core.logprobs`; None asks for none, the default, and costs
    nothing): ``logprobs`` ``k`` (0-20) on the ``last`` chunk asks for the last row's (the
    first generated token's candidates and ``k`` alternatives); ``prompt_logprobs`` ``k``
    asks for every row of this chunk, each scoring the prompt token after it (the chunk's
    own next token, ``next_token`` for the last row of a chunk that is not ``last``), which
    makes the chunk compute logits for every row, not just the last.

    ``mask`` (a constrained request's ``last`` chunk): int32 ``[1, ceil(vocab / 32)]``, the
    grammar bitmask of the last row (`specd_core.grammar`), applied to its logits before its
    rows are made (log probabilities stay the raw ones); None: unconstrained.
    """

    slot: int
    tokens: list[int]
    sampling: SamplingParams
    want_hidden: bool = False
    start_pos: int = 0
    offset: int = 0
    last: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    next_token: int | None = None
    mask: np.ndarray | None = dataclasses.field(default=None, compare=False)
    hidden_layers: tuple[int, ...] = ()


@dataclass(frozen=True)
class VerifyItem:
    """One verification step of the request in ``slot``.

    ``tokens`` is ``[anchor, *draft]`` (`DecodeRequest.verify_tokens`); ``start_pos`` is the
    request's committed KV length (`DecodeRequest.cache_len`), where the anchor is fed. The
    slot is rolled back to ``start_pos`` first, which discards the rejected positions of the
    previous step.

    ``logprobs`` ``k`` (0-20; None: none, the default, at no cost) asks for every row's raw
    log probabilities: the ``k`` most likely tokens and every token the row can commit
    (`specd_core.logprobs.commit_candidates`).

    ``mask`` (a constrained request): int32 ``[len(tokens), ceil(vocab / 32)]``, row ``i`` the
    grammar bitmask for row ``i`` (`specd_core.grammar.GrammarMatcher.draft`), applied to the
    logits before the rows for the rule are made; None: unconstrained.

    ``want_hidden`` asks for the hidden rows of every position fed; ``hidden_layers`` (read
    only with it; the drafter's `specd_core.draft.DrafterCapabilities.hidden_layers`, sorted)
    says which: ``()`` the final-norm rows ``[n, hidden_size]``, else the residual streams
    entering those target layers side by side, ``[n, len(hidden_layers) * hidden_size]``.
    A per-step field, not a replica setting: the target captures what the step's items ask
    (every item of one step that wants rows must ask the same layers), so a restarted or
    added replica, each tensor-parallel rank and the in-process engine need no setting kept
    in step with the drafters.
    """

    slot: int
    start_pos: int
    tokens: list[int]
    sampling: SamplingParams
    want_hidden: bool = False
    logprobs: int | None = None
    mask: np.ndarray | None = dataclasses.field(default=None, compare=False)
    hidden_layers: tuple[int, ...] = ()


@dataclass(frozen=True)
class StepOutput:
    """The target's answer for one item.

    Attributes:
        rows: what the rule needs per fed position (`specd_core.rule.target_rows`, compacted
            by `compact_rows`): 1 row for a prefill's last chunk (its last prompt position),
            None for an earlier chunk, ``len(tokens)`` rows for a verification.
        hidden: float32 hidden rows of every fed position (the chunk's rows for a prefill):
            ``[n, hidden_size]`` final-norm rows, or ``[n, len(hidden_layers) *
            hidden_size]`` residual streams when the item named layers; None unless the item
            asked for them.
        logprobs: raw log probabilities when the item asked (`specd_core.logprobs`): a
            verification's ``len(tokens)`` rows; a prefill chunk's rows (every row with
            ``prompt_logprobs``, else the ``last`` chunk's last row); None otherwise.
    """

    rows: GreedyRows | ProbRows | SparseProbRows | None
    hidden: torch.Tensor | None
    logprobs: RowLogprobs | None = None


def payload_bytes(obj) -> int:
    """Bytes of data a step's items or outputs carry, counted from their structure (no
    serialisation): a tensor or array its ``nbytes``, a numpy scalar its size, an int or float
    8, a bool or None 1, a str or bytes its length, and containers and dataclasses (items,
    outputs, rows, sampling parameters) the sum of their members. Pickle's framing (class
    names, opcodes: ~180 bytes for one greedy verify item) is not counted, so it is below the
    pickled size for a small step and within ~2% of it for one carrying hidden or probability
    rows.

    Raises:
        TypeError: naming a member type it does not know how to count.
    """
    kind = type(obj)
    if kind is int or kind is float:
        return 8
    if kind is list or kind is tuple:
        if all(type(x) is int for x in obj):  # token ids, argmax rows
            return 8 * len(obj)
        return sum(map(payload_bytes, obj))
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, np.ndarray | np.generic):
        return obj.nbytes
    if obj is None or kind is bool:
        return 1
    if isinstance(obj, int | float):  # subclasses (IntEnum, ...)
        return 8
    if isinstance(obj, str | bytes):
        return len(obj)
    if isinstance(obj, list | tuple):
        return sum(map(payload_bytes, obj))
    if isinstance(obj, dict):
        return sum(payload_bytes(k) + payload_bytes(v) for k, v in obj.items())
    names = _FIELDS.get(kind)
    if names is None:
        if not dataclasses.is_dataclass(obj):
            raise TypeError(f"payload_bytes cannot count a {kind.__name__}")
        names = _FIELDS[kind] = tuple(f.name for f in dataclasses.fields(obj))
    return sum(payload_bytes(getattr(obj, name)) for name in names)


#: Field names per dataclass type seen by `payload_bytes`.
_FIELDS: dict[type, tuple[str, ...]] = {}
