"""Sampling parameters, the target's sampling distribution, and per-request RNG.

Semantics follow vLLM's sampler (v1): penalties on the logits first (repetition over prompt
+ generated tokens, presence/frequency over generated tokens only), then temperature, then
min-p, top-k and top-p filtering on the probabilities. Temperature 0 is greedy: a one-hot at
the argmax of the penalised logits; so is any temperature below `GREEDY_TEMPERATURE` (vLLM's
``_SAMPLING_EPS = 1e-5`` in ``vllm/sampling_params.py``), where dividing float32 logits by it
would overflow and the distribution is a point mass at the argmax anyway.

Every legal `SamplingParams` gives valid rows (finite, non-negative, summing to 1) for any
finite logits of magnitude below ~3e31: temperatures under the epsilon are greedy, and the
repetition penalty is bounded (`REPETITION_PENALTY_RANGE`) so ``logit / penalty / temperature``
stays finite in float32.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

#: Temperatures below this are greedy (vLLM's ``_SAMPLING_EPS``); `SamplingParams` stores 0.0.
GREEDY_TEMPERATURE = 1e-5
#: Legal repetition penalties, inclusive. 0.01 already multiplies a seen token's logit by 100;
#: outside the range ``logit / penalty`` overflows float32 for ordinary logits (1e-45 did:
#: +inf logits, a NaN softmax, a request that could not be sampled).
REPETITION_PENALTY_RANGE = (0.01, 100.0)


class SamplingParamError(ValueError):
    """A `SamplingParams` field out of its range: ``field`` names it (``"top_p"``), ``value``
    is what it got, ``why`` the rule it broke; the message is
    ``SamplingParams.<field>=<value!r>: <why>``."""

    def __init__(self, field: str, value: object, why: str):
        super().__init__(f"SamplingParams.{field}={value!r}: {why}")
        self.field, self.value, self.why = field, value, why


@dataclass(frozen=True)
class SamplingParams:
    """How the target samples, validated on construction.

    Attributes:
        temperature: >= 0; 0 means greedy. A value below `GREEDY_TEMPERATURE` is greedy too
            and is stored as 0.0 (so every consumer, drafters included, sees greedy).
        top_k: keep the k most likely tokens; 0 disables.
        top_p: nucleus mass in (0, 1]; 1 disables.
        min_p: drop tokens below ``min_p * max_prob``, in [0, 1]; 0 disables.
        repetition_penalty: in `REPETITION_PENALTY_RANGE` ([0.01, 100]); 1 disables. Divides
            positive / multiplies negative logits of every token in the prompt or the output
            (CTRL, Keskar et al. 2019).
        presence_penalty: in [-2, 2]; subtracted once from each token in the output.
        frequency_penalty: in [-2, 2]; subtracted per occurrence in the output.

    Raises:
        SamplingParamError (a ValueError): naming the field whose value is out of range.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self) -> None:
        bad = SamplingParamError
        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise bad(name, value, "must be a number")
            if not math.isfinite(value):
                raise bad(name, value, "must be finite")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise bad("top_k", self.top_k, "must be an integer")
        if self.temperature < 0:
            raise bad("temperature", self.temperature, "must be >= 0")
        if self.top_k < 0:
            raise bad("top_k", self.top_k, "must be >= 0 (0 disables)")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "must be in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", self.min_p, "must be in [0, 1]")
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:
            raise bad("repetition_penalty", self.repetition_penalty,
                      f"must be in [{low:g}, {high:g}] (1 disables)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise bad(name, getattr(self, name), "must be in [-2, 2]")
        if 0.0 < self.temperature < GREEDY_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


def penalize(
    logits: torch.Tensor,
    params: SamplingParams,
    history: Sequence[int],
    num_prompt_tokens: int = 0,
    block: Sequence[int] = (),
) -> torch.Tensor:
    """Applies the repetition, presence and frequency penalties.

    Args:
        logits: float ``[vocab]`` or ``[n, vocab]``. With ``n`` rows, row ``i`` is judged as
            if ``block[:i]`` had been appended to ``history`` (inside a verified block,
            position i sees the draft tokens accepted before it; it is only evaluated when all
            of them were accepted).
        history: prompt + generated token ids; the first ``num_prompt_tokens`` are the
            prompt (repetition penalty only), the rest the output (all three penalties).
        block: ``n - 1`` (or more) tokens appended row by row; only ``block[:n-1]`` is used.

    Returns:
        A new float32 tensor of the same shape (``logits`` itself when no penalty is set).
    """
    if not params.has_penalties:
        return logits
    squeeze = logits.dim() == 1
    rows = logits.reshape(-1, logits.shape[-1]).to(torch.float32)
    n, vocab = rows.shape
    hist = torch.as_tensor(list(history), dtype=torch.long)
    out_tokens = hist[num_prompt_tokens:]
    counts = torch.bincount(out_tokens, minlength=vocab)[:vocab].to(torch.float32)
    seen = torch.zeros(vocab, dtype=torch.bool)
    seen[hist] = True
    # Row i adds block[:i]: cumulative one-hot counts, [n, vocab].
    counts = counts.expand(n, vocab).clone()
    seen = seen.expand(n, vocab).clone()
    for i in range(1, n):
        counts[i:, block[i - 1]] += 1
        seen[i:, block[i - 1]] = True
    rows = rows.clone()
    if params.repetition_penalty != 1.0:
        penalty = params.repetition_penalty
        scaled = torch.where(rows > 0, rows / penalty, rows * penalty)
        rows = torch.where(seen, scaled, rows)
    if params.frequency_penalty != 0.0:
        rows -= params.frequency_penalty * counts
    if params.presence_penalty != 0.0:
        rows -= params.presence_penalty * (counts > 0).to(torch.float32)
    return rows[0] if squeeze else rows


def _filter_probs(probs: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """min-p, top-k, top-p on row-wise probabilities ``[n, vocab]``; renormalised."""
    if params.min_p > 0.0:
        threshold = params.min_p * probs.max(dim=-1, keepdim=True).values
        probs = torch.where(probs < threshold, torch.zeros_like(probs), probs)
    vocab = probs.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(probs, params.top_k, dim=-1).values[..., -1:]
        probs = torch.where(probs < kth, torch.zeros_like(probs), probs)
    if params.top_p < 1.0:
        probs = _top_p(probs, params.top_p)
    return probs / probs.sum(dim=-1, keepdim=True)


# The nucleus almost always lies within the top few hundred tokens: sort those, not the vocab.
_TOP_P_CANDIDATES = 1024


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keeps, per row of ``[n, vocab]``, the smallest most-likely prefix whose mass reaches
    ``top_p`` of the row's total (the top token always survives)."""
    total = probs.sum(dim=-1, keepdim=True)
    k = min(probs.shape[-1], _TOP_P_CANDIDATES)
    values, order = torch.topk(probs, k, dim=-1)  # sorted, descending
    if k < probs.shape[-1] and not bool((values.sum(-1, keepdim=True) >= top_p * total).all()):
        values, order = torch.sort(probs, dim=-1, descending=True)  # a very flat row
    mass_before = torch.cumsum(values, dim=-1) - values
    keep_sorted = mass_before < top_p * total
    keep_sorted[..., 0] = True
    keep = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, keep_sorted)
    return torch.where(keep, probs, torch.zeros_like(probs))


def sampling_distributions(
    logits: torch.Tensor,
    params: SamplingParams,
    history: Sequence[int],
    num_prompt_tokens: int = 0,
    block: Sequence[int] = (),
) -> torch.Tensor:
    """Row-wise `sampling_distribution` for a verified block.

    Args:
        logits: float ``[n, vocab]`` target logits; row ``i`` follows ``history + block[:i]``.

    Returns:
        float32 ``[n, vocab]``, each row summing to 1 (one-hot at the argmax when greedy).
    """
    rows = penalize(logits.reshape(-1, logits.shape[-1]), params, history,
                    num_prompt_tokens, block).to(torch.float32)
    if params.greedy:
        probs = torch.zeros_like(rows)
        probs.scatter_(-1, rows.argmax(dim=-1, keepdim=True), 1.0)
        return probs
    probs = torch.softmax(rows / params.temperature, dim=-1)
    return _filter_probs(probs, params)


def sampling_distribution(
    logits: torch.Tensor,
    params: SamplingParams,
    history: Sequence[int],
    num_prompt_tokens: int = 0,
) -> torch.Tensor:
    """The distribution the target samples its next token from.

    Args:
        logits: float ``[vocab]`` raw target logits for the next position.
        params: the request's sampling parameters.
        history: prompt + generated token ids so far (``num_prompt_tokens`` of them prompt).

    Returns:
        float32 ``[vocab]`` summing to 1; a one-hot at the argmax when temperature is 0.
    """
    return sampling_distributions(logits.reshape(1, -1), params, history, num_prompt_tokens)[0]


def greedy_tokens(
    logits: torch.Tensor,
    params: SamplingParams,
    history: Sequence[int],
    num_prompt_tokens: int = 0,
    block: Sequence[int] = (),
) -> list[int]:
    """Argmax per row of the penalised logits ``[n, vocab]``: the temperature-0 support of
    `sampling_distributions`, without materialising one-hot rows."""
    rows = penalize(logits.reshape(-1, logits.shape[-1]), params, history,
                    num_prompt_tokens, block)
    return rows.argmax(dim=-1).tolist()


class Sampler:
    """A request's own random generator (PCG64, seeded), so its tokens never depend on what
    else is running.

    ``seed=None`` draws fresh OS entropy (an unseeded request).
    """

    def __init__(self, seed: int | None = 0):
        self._rng = np.random.Generator(np.random.PCG64(seed))

    def uniform(self) -> float:
        """A float in [0, 1)."""
        return float(self._rng.random())

    def sample_from(self, probs: torch.Tensor | np.ndarray | Sequence[float]) -> int:
        """Draws an index from a (possibly unnormalised) non-negative ``[vocab]`` vector by
        inverse CDF; never returns an index of zero probability.

        Raises:
            ValueError: the vector has no positive mass.
        """
        if isinstance(probs, torch.Tensor):
            probs = (probs if probs.dim() == 1 else probs.reshape(-1)).detach().numpy()
        cdf = np.cumsum(probs, dtype=np.float64)
        total = float(cdf[-1]) if cdf.size else 0.0
        if not total > 0.0:
            raise ValueError("cannot sample from a distribution with no positive mass")
        index = int(cdf.searchsorted(self._rng.random() * total, side="right"))
        if index >= cdf.size:  # u * total rounded up to total
            index = int(cdf.searchsorted(total, side="left"))
        return index


@dataclass(frozen=True)
class DraftSamplingParams:
    """The request transforms a sampling drafter applies before sampling (0 / 1.0 = off).

    Raises:
        ValueError: negative temperature or top_k, or top_p outside (0, 1].
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature >= 0 or not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def draft_sampling(params: SamplingParams):
    """The part of ``params`` a sampling drafter applies (`DraftSamplingParams`)."""
    return DraftSamplingParams(temperature=params.temperature, top_k=params.top_k,
                               top_p=params.top_p)
