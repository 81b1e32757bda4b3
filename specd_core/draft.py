"""Draft blocks and the `Drafter` interface.

A drafter proposes candidate continuation tokens together with, per position, the
distribution each token was drawn from. The verifier (`specd_core.rule`) needs that
distribution `q` to apply the speculative-sampling rejection rule (Leviathan et al. 2023,
arXiv 2211.17192; Chen et al. 2023, arXiv 2302.01318), which is lossless at every
temperature only when `q` is honest.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import torch

# Tolerance on sum(q) == 1: a float32 softmax renormalised over a top-k is within ~1e-6.
_SUM_TOLERANCE = 1e-3


class DraftDist:
    """The distribution one drafted position was sampled from, as its complete support.

    Sparse rather than a dense vocabulary-length vector because drafters' distributions are
    sparse: prompt lookup's support is one token, a model drafter's a top-k.

    Contract: the support must be the distribution the draft token was *actually* sampled
    from. A drafter that truncates its softmax to a top-k before sampling must report the
    truncated, renormalised distribution.

    Raises:
        ValueError: a negative, non-finite or duplicate entry, or probabilities that do not
            sum to 1 (within 1e-3).
    """

    __slots__ = ("_support", "_index", "_arrays")

    def __init__(self, support: Iterable[tuple[int, float]]):
        pairs = [(int(t), float(p)) for t, p in support]
        index: dict[int, float] = {}
        for token, prob in pairs:
            if token < 0:
                raise ValueError(f"DraftDist: token id {token} is negative")
            if not math.isfinite(prob) or prob < 0.0:
                raise ValueError(f"DraftDist: probability {prob} of token {token} is invalid")
            if token in index:
                raise ValueError(f"DraftDist: token {token} appears twice in the support")
            index[token] = prob
        total = sum(index.values())
        if abs(total - 1.0) > _SUM_TOLERANCE:
            raise ValueError(f"DraftDist: probabilities sum to {total}, not 1")
        self._support = tuple(pairs)
        self._index = index
        self._arrays: tuple[np.ndarray, np.ndarray] | None = None

    @classmethod
    def deterministic(cls, token: int) -> DraftDist:
        """All probability on one token: what a lookup drafter honestly reports."""
        return cls([(token, 1.0)])

    @classmethod
    def from_dense(cls, probs: Sequence[float] | torch.Tensor) -> DraftDist:
        """The nonzero entries of a dense probability vector ``[vocab]``."""
        dense = torch.as_tensor(probs, dtype=torch.float64).reshape(-1)
        nonzero = torch.nonzero(dense > 0).reshape(-1)
        return cls(zip(nonzero.tolist(), dense[nonzero].tolist(), strict=True))

    @classmethod
    def from_support(cls, support: Iterable[tuple[int, float]]) -> DraftDist:
        """Builds from explicit ``(token, probability)`` pairs."""
        return cls(support)

    def support(self) -> tuple[tuple[int, float], ...]:
        """The ``(token, probability)`` pairs, in construction order."""
        return self._support

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """The support as (int64 token ids ``[s]``, float64 probabilities ``[s]``), cached."""
        if self._arrays is None:
            self._arrays = (
                np.fromiter(self._index.keys(), dtype=np.int64, count=len(self._index)),
                np.fromiter(self._index.values(), dtype=np.float64, count=len(self._index)),
            )
        return self._arrays

    def prob(self, token: int) -> float:
        """``q(token)``, or 0.0 for a token outside the support."""
        return self._index.get(int(token), 0.0)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DraftDist) and self._support == other._support

    def __repr__(self) -> str:
        return f"DraftDist({list(self._support)!r})"


class DraftBlock:
    """Drafted tokens plus, per position, the distribution that position was drawn from.

    ``tokens`` and ``dists`` always have the same length: the rule needs ``q`` for every
    token it might have to reject, so a block without one could not be verified losslessly.

    Raises:
        ValueError: the lengths differ, or a token has zero probability under its own
            distribution (it could not have been sampled from it).
    """

    __slots__ = ("_tokens", "_dists")

    def __init__(self, tokens: Sequence[int], dists: Sequence[DraftDist]):
        tokens = [int(t) for t in tokens]
        dists = list(dists)
        if len(tokens) != len(dists):
            raise ValueError(
                f"a draft block needs one draft distribution per drafted token "
                f"(got {len(tokens)} tokens and {len(dists)} distributions)"
            )
        for i, (token, dist) in enumerate(zip(tokens, dists, strict=True)):
            if dist.prob(token) <= 0.0:
                raise ValueError(
                    f"draft position {i}: token {token} has probability 0 under its own "
                    "draft distribution, so it cannot have been sampled from it"
                )
        self._tokens = tokens
        self._dists = dists

    @classmethod
    def empty(cls) -> DraftBlock:
        return cls([], [])

    @classmethod
    def deterministic(cls, tokens: Sequence[int]) -> DraftBlock:
        """A block whose every position is certain: honest for a lookup drafter, wrong for a
        model-based one, which must report its real softmax."""
        return cls(tokens, [DraftDist.deterministic(t) for t in tokens])

    @property
    def tokens(self) -> tuple[int, ...]:
        return tuple(self._tokens)

    @property
    def dists(self) -> tuple[DraftDist, ...]:
        return tuple(self._dists)

    def __len__(self) -> int:
        return len(self._tokens)

    def len(self) -> int:
        """Number of drafted positions (same as ``len(block)``)."""
        return len(self._tokens)

    def is_empty(self) -> bool:
        return not self._tokens

    def truncate(self, length: int) -> DraftBlock:
        """Drops everything past ``length`` positions in place, tokens and dists together.

        Returns ``self`` for chaining. Raises ValueError for a negative length.
        """
        if length < 0:
            raise ValueError(f"truncate length must be >= 0, got {length}")
        del self._tokens[length:]
        del self._dists[length:]
        return self

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, DraftBlock)
            and self._tokens == other._tokens
            and self._dists == other._dists
        )

    def __repr__(self) -> str:
        return f"DraftBlock(tokens={self._tokens!r})"


@dataclass(frozen=True)
class DrafterCapabilities:
    """What a `Drafter` declares about itself, so callers need not probe it.

    Attributes:
        wants_hidden: it conditions on the target's hidden rows (callers then keep and ship
            them); False: it always receives ``None``.
        hidden_layers: which hidden rows: ``()`` the target's final-norm rows (the LM head's
            input, ``[rows, hidden_size]``: EAGLE-1); else the residual streams entering
            these target layers (``i`` in ``[0, n_layers]``, ``n_layers`` the last layer's
            output before the final norm; `target_worker.model.Decoder.set_capture_layers`),
            side by side in ascending order, ``[rows, len(hidden_layers) * hidden_size]``
            (EAGLE-3 reads ``(2, N // 2, N - 3)``, arXiv 2503.01840). Stored sorted; needs
            ``wants_hidden``.
        max_draft_len: the most tokens one proposal drafts (None: no cap of its own); the
            adaptive chooser never asks for more.
        sessions: it keeps per-request state: ``drafter.session(sampling, seed)`` (sampling a
            `specd_core.sampling.DraftSamplingParams` or None, seed an int) returns a fresh
            per-request `Drafter` that samples with the request's transforms and seed.
        samples: its drafts are sampled (an honest ``q`` wider than a point mass), not looked
            up; with a point-mass drafter, seeded output does not depend on the draft length.
        remembers: it keeps a cache across requests: ``drafter.remember(outputs,
            partitions)`` (an iterable of token-id sequences, finished requests' outputs
            without their prompts, and one partition str per output: the requests' tenant
            and ``cache_salt``, "" shared) adds to it; callers then send every finished
            output (suffix decoding). With ``sessions`` too, its sessions are made with
            ``drafter.session(sampling, seed, partition)`` and draft only from that
            partition's outputs.

    The defaults are what a drafter that declares nothing gets: hidden rows are passed (it
    may ignore them), no cap, one shared instance, treated as sampling.
    """

    wants_hidden: bool = True
    max_draft_len: int | None = None
    sessions: bool = False
    samples: bool = True
    remembers: bool = False
    hidden_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_draft_len is not None and (
                isinstance(self.max_draft_len, bool) or int(self.max_draft_len) < 1):
            raise ValueError(f"max_draft_len must be None or >= 1, got {self.max_draft_len!r}")
        layers = check_hidden_layers(self.hidden_layers)
        if layers and not self.wants_hidden:
            raise ValueError(f"hidden_layers {list(layers)} needs wants_hidden (a drafter "
                             "that reads no hidden rows names no layers)")
        object.__setattr__(self, "hidden_layers", layers)


def check_hidden_layers(layers) -> tuple[int, ...]:
    """``layers`` (`DrafterCapabilities.hidden_layers`) as a sorted tuple, after checking
    they are non-negative ints (not bools) with no repeats. Whether the target has them is
    the target's check (`target_worker.model.Decoder.set_capture_layers`).

    Raises:
        ValueError: naming ``hidden_layers`` and the value: not a sequence of ints, a
            negative layer or a repeated one.
    """
    try:
        values = tuple(layers)
    except TypeError:
        raise ValueError(f"hidden_layers must be a sequence of layer indices, got "
                         f"{layers!r}") from None
    for i in values:
        if isinstance(i, bool) or not isinstance(i, int | np.integer) or i < 0:
            raise ValueError(f"hidden_layers: {i!r} is not a layer index (an int >= 0) in "
                             f"{list(values)!r}")
    values = tuple(sorted(int(i) for i in values))
    if len(set(values)) != len(values):
        raise ValueError(f"hidden_layers: a layer repeats in {list(values)}")
    return values


def drafter_capabilities(drafter: object) -> DrafterCapabilities:
    """The `DrafterCapabilities` of ``drafter``: its ``capabilities`` attribute, or, for a
    drafter that declares none, the defaults with the seed's attribute declarations honoured
    (``wants_hidden``, ``max_draft_len``, ``hidden_layers``, a ``session`` method). The one
    place that reads a drafter's capabilities.

    Raises:
        ValueError: a ``hidden_layers`` attribute `DrafterCapabilities` refuses.
    """
    caps = getattr(drafter, "capabilities", None)
    if isinstance(caps, DrafterCapabilities):
        return caps
    limit = getattr(drafter, "max_draft_len", None)
    return DrafterCapabilities(
        wants_hidden=bool(getattr(drafter, "wants_hidden", True)),
        max_draft_len=int(limit) if isinstance(limit, int) and limit >= 1 else None,
        sessions=callable(getattr(drafter, "session", None)),
        hidden_layers=getattr(drafter, "hidden_layers", None) or (),
    )


@runtime_checkable
class Drafter(Protocol):
    """Proposes a block of candidate continuation tokens.

    ``propose(history, target_hidden, max_len)``:

    - ``history``: committed token ids, prompt first; its last entry is the pending anchor
      token, decided but not yet in the target's KV cache; the first drafted token lands
      right after it.
    - ``target_hidden``: float32 ``[rows, hidden_size]``, the target's final-norm hidden
      states (the input of its LM head) for every position committed since this request's
      previous ``propose`` call (all prompt positions on the first call); for a drafter
      declaring ``hidden_layers``, ``[rows, len(hidden_layers) * hidden_size]``, the
      residual streams entering those layers (`DrafterCapabilities.hidden_layers`). The last
      row is the state whose logits chose the anchor. ``None`` when the caller has none; a
      drafter that needs it must then propose nothing. Drafters that do not need it ignore it.
    - ``max_len``: the most tokens the caller will verify; proposing more is allowed (the
      caller truncates) but wasted.

    A drafter declares what it is through a ``capabilities`` attribute (`DrafterCapabilities`;
    read it with `drafter_capabilities`); one that declares nothing gets the defaults.
    """

    def propose(
        self, history: Sequence[int], target_hidden: torch.Tensor | None, max_len: int
    ) -> DraftBlock: ...



def propose_ahead(drafter: object, history: Sequence[int], target_hidden: torch.Tensor | None,
                  assumed: Sequence[int], max_len: int) -> DraftBlock:
    """A run-ahead proposal (pipelined scheduling): drafted while the target verifies
    ``assumed`` (the block fed after the anchor, which has no hidden rows yet), for the
    case that verification commits all of it.

    The returned block's first token is the drafter's guess of the token verification
    commits after ``history + assumed`` (the bonus token); the rest is the drafter's block
    for ``history + assumed + [guess]``. The caller uses the rest only when verification
    committed exactly that prefix, so it is judged against the history it was drawn for.

    ``drafter.propose_ahead(history, target_hidden, assumed, max_len)`` when it has one (a
    stateful drafter continuing past ``assumed`` on its own predictions, such as EAGLE). A
    drafter that ignores hidden rows is asked twice: ``propose(history + assumed, None, 1)``
    for the guess, then ``propose(history + assumed + [guess], None, max_len - 1)``, so on a
    hit the block is exactly what it would propose after the committed history. Any other
    drafter cannot run ahead and proposes nothing. ``target_hidden``: the committed rows, as
    for `Drafter.propose`; ``max_len`` counts the guess.
    """
    ahead = getattr(drafter, "propose_ahead", None)
    if callable(ahead):
        return ahead(history, target_hidden, assumed, max_len)
    if max_len <= 0 or drafter_capabilities(drafter).wants_hidden:
        return DraftBlock.empty()
    seen = [*history, *assumed]
    first = drafter.propose(seen, None, 1)
    if not len(first):
        return DraftBlock.empty()
    guess = first.tokens[0]
    rest = drafter.propose([*seen, guess], None, max_len - 1) if max_len > 1 else DraftBlock.empty()
    keep = max_len - 1  # sliced, not truncated: the drafter may keep the block it returned
    return DraftBlock([guess, *rest.tokens[:keep]], [first.dists[0], *rest.dists[:keep]])
