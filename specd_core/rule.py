"""The speculative-sampling accept/reject rule and what it needs from the target.

Leviathan et al. 2023 (arXiv 2211.17192), Chen et al. 2023 (arXiv 2302.01318): a draft token
``x`` drawn from ``q`` is accepted with probability ``min(1, p(x)/q(x))``; on rejection the
position is resampled from the normalised residual ``max(0, p - q)``. The output is then
distributed exactly as ``p`` at every temperature. At temperature 0, ``p`` is a point mass at
the argmax and the rule reduces to "accept iff the draft is the argmax, else emit the argmax".

For a point-mass draft (``q(x) = 1``, what prompt lookup proposes) the rule is applied in its
coupled form: the position is drawn from ``p`` with one uniform exactly as plain sampling
draws it, and the draft is accepted iff the draw equals it. That has the same acceptance
probability and the same residual, and makes every committed token consume one uniform in
output order, so seeded output with such a drafter is token-identical to plain decoding at
any draft length (adaptive or fixed), at every temperature.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .draft import DraftDist
from .sampling import Sampler, SamplingParams, greedy_tokens, sampling_distributions


def accept_or_resample(
    target_probs: torch.Tensor | Sequence[float],
    draft: DraftDist,
    token: int,
    rng: Sampler,
) -> int | None:
    """The accept/reject decision for one drafted position.

    Args:
        target_probs: float ``[vocab]``, the target's *final* sampling distribution for this
            position (after penalties, temperature, min-p/top-k/top-p: what
            `sampling_distribution` returns), since that is what plain decoding draws from.
        draft: the distribution ``token`` was drawn from.
        token: the drafted token id.
        rng: the request's own generator.

    Returns:
        ``None`` when accepted, else the replacement drawn from the normalised residual
        ``max(0, p - q)``. A token with ``q(token) == 0`` breaks the `DraftDist` contract; it
        is accepted (the ``p/q -> inf`` limit) rather than silently biasing the output.
    """
    return _rule(_as_numpy(target_probs), None, draft, int(token), rng)


def _support_index(ids: np.ndarray | None, width: int, tokens: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Where ``tokens`` sit in a row (dense when ``ids`` is None, else its sorted support):
    (positions, mask of the tokens present)."""
    if ids is None:
        return tokens, (tokens >= 0) & (tokens < width)
    at = np.searchsorted(ids, tokens)
    hit = at < ids.shape[0]
    hit[hit] = ids[at[hit]] == tokens[hit]
    return at, hit


def _rule(probs: np.ndarray, ids: np.ndarray | None, draft: DraftDist, token: int,
          rng: Sampler) -> int | None:
    """`accept_or_resample` on one target row: dense ``probs [vocab]`` (``ids`` None) or a
    sparse support (``probs[j] = p(ids[j])``, ``ids`` increasing). Tokens outside a sparse
    support have p = 0, where the dense residual ``max(0, 0 - q)`` is 0 too, so both forms
    make the same decisions and draw the same tokens from the same generator state."""
    q = draft.prob(token)
    if q >= 1.0:
        # A point-mass draft (prompt lookup): draw the position exactly as plain decoding
        # would (one uniform, inverse CDF) and accept iff that draw is the draft. Accepted
        # with probability p(x) = min(1, p/q) and, on rejection, distributed as p without x,
        # the normalised residual: the same rule, coupled to plain sampling, so a seeded
        # request's output never depends on whether or how far it drafted.
        chosen = rng.sample_from(probs)
        chosen = chosen if ids is None else int(ids[chosen])
        return None if chosen == token else chosen
    at, hit = _support_index(ids, probs.shape[0], np.array([token]))
    p = float(probs[at[0]]) if hit[0] else 0.0
    if q <= 0.0 or p >= q:
        return None
    if rng.uniform() < p / q:  # p < q: a real coin flip
        return None
    residual = probs.astype(np.float64)
    tokens, qs = draft.arrays()
    at, hit = _support_index(ids, probs.shape[0], tokens)
    at, qs = at[hit], qs[hit]
    residual[at] = np.maximum(residual[at] - qs, 0.0)
    # An empty residual only when p == q, where acceptance was certain; sampling from
    # nothing is not an option, so fall back to the target itself.
    chosen = rng.sample_from(residual if residual.sum() > 0.0 else probs)
    return chosen if ids is None else int(ids[chosen])


def _as_numpy(probs: torch.Tensor | np.ndarray | Sequence[float]) -> np.ndarray:
    if isinstance(probs, torch.Tensor):
        return (probs if probs.dim() == 1 else probs.reshape(-1)).detach().numpy()
    return np.asarray(probs).reshape(-1)


@dataclass(frozen=True)
class GreedyRows:
    """Temperature-0 target output for a verified block: the argmax per row, ``n`` ints.

    Exactly `accept_or_resample` against a point mass, without shipping ``[n, vocab]``.
    """

    argmax: tuple[int, ...]

    def judge(self, i: int, token: int, dist: DraftDist, rng: Sampler) -> int | None:
        return None if token == self.argmax[i] else self.argmax[i]

    def sample(self, i: int, rng: Sampler) -> int:
        return self.argmax[i]

    def __len__(self) -> int:
        return len(self.argmax)


@dataclass(frozen=True)
class ProbRows:
    """Sampling target output for a verified block: float32 ``[n, vocab]`` final
    distributions, row ``i`` judging draft position ``i`` (the last row is the bonus)."""

    probs: torch.Tensor

    def judge(self, i: int, token: int, dist: DraftDist, rng: Sampler) -> int | None:
        return accept_or_resample(self.probs[i], dist, token, rng)

    def sample(self, i: int, rng: Sampler) -> int:
        return rng.sample_from(self.probs[i])

    def __len__(self) -> int:
        return self.probs.shape[0]


@dataclass(frozen=True, eq=False)
class SparseProbRows:
    """`ProbRows` storing only each row's nonzero entries (CSR layout), for the top-k/top-p/
    min-p distributions whose support is a few tokens out of the vocabulary.

    Row ``i`` is ``token_ids[offsets[i]:offsets[i + 1]]`` (strictly increasing) with
    probabilities ``probs[offsets[i]:offsets[i + 1]]``; every other token has probability 0.
    Decisions and sampled tokens are bit-identical to `ProbRows` on the dense rows for the same
    `Sampler` state: inverse-CDF sampling accumulates in float64 in increasing token order, and
    dropping exact zeros from that order leaves every partial sum unchanged.

    Attributes:
        offsets: int64 ``[n + 1]``, ``offsets[0] == 0``.
        token_ids: int32 ``[nnz]``.
        probs: float32 ``[nnz]``, the dense rows' nonzero values.
        vocab_size: width of the dense rows.
    """

    offsets: np.ndarray
    token_ids: np.ndarray
    probs: np.ndarray
    vocab_size: int

    @classmethod
    def from_dense(cls, probs: torch.Tensor) -> SparseProbRows:
        """From float32 rows ``[n, vocab]``; keeps every entry that is not exactly 0."""
        dense = probs.detach().reshape(-1, probs.shape[-1]).to(torch.float32)
        rows, cols = torch.nonzero(dense != 0, as_tuple=True)  # row-major: columns ascending
        offsets = np.zeros(dense.shape[0] + 1, dtype=np.int64)
        np.cumsum(np.bincount(rows.numpy(), minlength=dense.shape[0]), out=offsets[1:])
        return cls(offsets, cols.numpy().astype(np.int32), dense[rows, cols].numpy(),
                   dense.shape[1])

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Row ``i`` as (int32 token ids ``[s]``, float32 probabilities ``[s]``)."""
        lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.token_ids[lo:hi], self.probs[lo:hi]

    def to_dense(self) -> torch.Tensor:
        """The float32 ``[n, vocab]`` rows."""
        dense = np.zeros((len(self), self.vocab_size), dtype=np.float32)
        rows = np.repeat(np.arange(len(self)), np.diff(self.offsets))
        dense[rows, self.token_ids] = self.probs
        return torch.from_numpy(dense)

    def nbytes(self) -> int:
        return self.offsets.nbytes + self.token_ids.nbytes + self.probs.nbytes

    def judge(self, i: int, token: int, dist: DraftDist, rng: Sampler) -> int | None:
        ids, probs = self.row(i)
        return _rule(probs, ids, dist, int(token), rng)

    def sample(self, i: int, rng: Sampler) -> int:
        ids, probs = self.row(i)
        return int(ids[rng.sample_from(probs)])

    def __len__(self) -> int:
        return self.offsets.shape[0] - 1


TargetRows = GreedyRows | ProbRows | SparseProbRows


def compact_rows(rows: TargetRows) -> TargetRows:
    """`rows` in its smallest bit-exact form: a `ProbRows` becomes `SparseProbRows` when its
    nonzeros (8 bytes each, plus 8 per row) take fewer bytes than the dense float32 rows;
    anything else (also non-float32 rows, which would not round-trip exactly) is returned
    unchanged."""
    if not isinstance(rows, ProbRows) or rows.probs.dtype != torch.float32:
        return rows
    n, vocab = rows.probs.shape
    nnz = int(torch.count_nonzero(rows.probs))
    if nnz * 8 + (n + 1) * 8 >= n * vocab * 4:
        return rows
    return SparseProbRows.from_dense(rows.probs)


def target_rows(
    logits: torch.Tensor,
    params: SamplingParams,
    history: Sequence[int],
    num_prompt_tokens: int,
    block: Sequence[int] = (),
) -> TargetRows:
    """What the rule needs from target logits ``[n, vocab]`` of a verified block.

    Row ``i`` follows ``history + block[:i]`` (``history`` ends with the anchor). Greedy
    requests get the argmax per row, others the full sampling distributions.
    """
    if params.greedy:
        return GreedyRows(tuple(greedy_tokens(logits, params, history, num_prompt_tokens, block)))
    return ProbRows(sampling_distributions(logits, params, history, num_prompt_tokens, block))
