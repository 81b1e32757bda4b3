"""Log probabilities of the target's rows, for the API's ``logprobs`` (OpenAI's and vLLM's).

Values are the target's *raw* log-softmax over the decoder's logits at each position: before
penalties, temperature or any filter (vLLM's default ``logprobs_mode``), so they do not depend
on how a request samples, and a token's value is the same with and without speculation (both
feed the same ids at the same positions; only float rounding of a packed forward differs).

The target computes them where it already has the logits (a prefill chunk, a verified block)
and ships, per row, the top ``k`` and the raw value of every token the row can commit, so the
coordinator can record the committed token's value whatever the accept/reject rule picks:

- a greedy row commits its (penalised) argmax, which is also what an accepted draft equals;
- a sampling row commits a token of its support (the nonzero entries of `SparseProbRows`, or
  any token of a dense `ProbRows`: then the whole raw row is shipped);
- a draft token is listed too (an accepted draft has nonzero probability by the rule's
  contract; listing it costs 8 bytes and keeps a contract breach from failing the request);
- a prompt row commits nothing: it scores the prompt token that follows it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .rule import GreedyRows, ProbRows, SparseProbRows, TargetRows

__all__ = ["MAX_TOP_LOGPROBS", "RowLogprobs", "TokenLogprob", "check_top_count",
           "commit_candidates", "row_logprobs"]

#: The most top alternatives a position may carry (OpenAI's chat ``top_logprobs`` bound).
MAX_TOP_LOGPROBS = 20


def check_top_count(name: str, value: int | None) -> int | None:
    """``value`` when it is None or an int in ``[0, MAX_TOP_LOGPROBS]``.

    Raises:
        ValueError: naming ``name``.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int or None, got {value!r}")
    if not 0 <= value <= MAX_TOP_LOGPROBS:
        raise ValueError(f"{name} must be in [0, {MAX_TOP_LOGPROBS}], got {value}")
    return value


@dataclass(frozen=True)
class TokenLogprob:
    """One position's record: the token there, its raw log probability (natural log, a
    float <= 0) and the ``k`` most likely tokens at that position as ``(id, logprob)``,
    most likely first (ties in id order as `torch.topk` gives them)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, eq=False)
class RowLogprobs:
    """Raw log probabilities of ``n`` target rows (row ``i`` is the distribution of the token
    after fed position ``i``).

    Attributes:
        top_ids: int32 ``[n, k]``, each row's ``k`` most likely token ids, most likely first.
        top_logprobs: float32 ``[n, k]``, their log probabilities.
        offsets: int64 ``[n + 1]``; row ``i``'s listed tokens are ``token_ids[offsets[i]:
            offsets[i + 1]]`` (strictly increasing) with values ``logprobs[...]`` (CSR).
        token_ids: int32 ``[nnz]``, the tokens each row can commit or scores.
        logprobs: float32 ``[nnz]``.
        full: float32 ``[n, vocab]``, every token's value, when a row may commit any token
            (a dense sampling distribution); None otherwise.
    """

    top_ids: np.ndarray
    top_logprobs: np.ndarray
    offsets: np.ndarray
    token_ids: np.ndarray
    logprobs: np.ndarray
    full: np.ndarray | None = None

    def __len__(self) -> int:
        return self.offsets.shape[0] - 1

    def value(self, i: int, token: int) -> float:
        """Row ``i``'s log probability of ``token``.

        Raises:
            KeyError: the row does not list ``token`` (it could not have been committed
                there: a caller's bug).
        """
        if self.full is not None:
            return float(self.full[i, token])
        lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
        at = lo + int(np.searchsorted(self.token_ids[lo:hi], token))
        if at < hi and int(self.token_ids[at]) == token:
            return float(self.logprobs[at])
        hit = np.flatnonzero(self.top_ids[i] == token)
        if hit.size:
            return float(self.top_logprobs[i, hit[0]])
        raise KeyError(f"row {i} has no log probability for token {token}")

    def record(self, i: int, token: int, k: int) -> TokenLogprob:
        """`TokenLogprob` of ``token`` at row ``i`` with the row's first ``k`` alternatives
        (``k`` at most the shipped width)."""
        top = tuple(zip(self.top_ids[i, :k].tolist(), self.top_logprobs[i, :k].tolist(),
                        strict=True))
        return TokenLogprob(int(token), self.value(i, token), top)


def commit_candidates(rows: TargetRows, drafts: Sequence[int] = ()
                      ) -> tuple[list[np.ndarray], bool]:
    """What each of ``rows`` can commit (see the module docstring): per row the int64 ids
    (greedy argmax or sparse support, plus ``drafts[i]`` for row ``i < len(drafts)``), and
    whether any row may commit every token (a dense `ProbRows`: ship the full row)."""
    n = len(rows)
    out = []
    for i in range(n):
        extra = [int(drafts[i])] if i < len(drafts) else []
        if isinstance(rows, GreedyRows):
            ids = np.array([rows.argmax[i], *extra], dtype=np.int64)
        elif isinstance(rows, SparseProbRows):
            ids = np.concatenate([rows.row(i)[0].astype(np.int64),
                                  np.array(extra, dtype=np.int64)])
        else:
            ids = np.array(extra, dtype=np.int64)
        out.append(ids)
    return out, isinstance(rows, ProbRows)


def row_logprobs(logits: torch.Tensor, k: int, candidates: Sequence[np.ndarray],
                 full: bool = False) -> RowLogprobs:
    """`RowLogprobs` of float logits ``[n, vocab]`` (raw, as the decoder returned them).

    Args:
        k: top alternatives per row, ``0 <= k``; clipped to the vocabulary.
        candidates: per row, the token ids to list (any order, repeats allowed).
        full: ship every row whole (``RowLogprobs.full``).
    """
    lp = torch.log_softmax(logits.float(), dim=-1)
    n, vocab = lp.shape
    k = min(k, vocab)
    if k:
        values, ids = torch.topk(lp, k, dim=-1)
        top_ids = ids.to(torch.int32).numpy()
        top_values = values.numpy()
    else:
        top_ids = np.zeros((n, 0), dtype=np.int32)
        top_values = np.zeros((n, 0), dtype=np.float32)
    rows = [np.unique(np.asarray(c, dtype=np.int64)) for c in candidates]
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum([r.size for r in rows], out=offsets[1:])
    token_ids = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
    row_of = np.repeat(np.arange(n), np.diff(offsets))
    lp_np = lp.numpy()
    values = lp_np[row_of, token_ids].astype(np.float32, copy=False)
    return RowLogprobs(top_ids, top_values, offsets, token_ids.astype(np.int32), values,
                       lp_np if full else None)
