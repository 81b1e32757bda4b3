"""EAGLE-3 drafting: `Eagle3Session` (one request's KV cache over committed positions),
`Eagle3Drafter` (a loaded head, the sessions' factory) and `SuffixThenEagle3`, and the
dtype a drafting head's weights use."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from specd_core.draft import DraftBlock, DraftDist, DrafterCapabilities, propose_ahead
from specd_core.sampling import DraftSamplingParams

from ..eagle import NeedsResync, rows_continue
from .head import Eagle3Head
from .loading import load_eagle3


def default_head_dtype() -> torch.dtype:
    """The dtype of a drafting head's matmul weights unless told: bfloat16 where the CPU
    computes bfloat16 dot products natively (`target_worker.loader.cpu_has_bf16_dot`; the
    head always drafts on the CPU), else float32.

    Why (``python scripts/eagle3_draft_cost.py``, SmolLM2-shaped heads, 1 thread, Zen 4 with
    AVX512-BF16 and no AMX, beside a busy training job, medians of 9 interleaved rounds,
    2026-12-03): a drafted token cost 1.8 / 2.4 / 3.5 / 5.0 ms in bfloat16 against 3.5 / 4.5
    / 7.2 / 11.2 ms in float32 for draft vocabularies of 4k / 8k / 16k / 32k (oneDNN's
    reordered bfloat16 weights, `_Linear`), and ingesting a step's 1-4 rows 2.2-3.3 against
    3.1-5.6 ms. Without native bfloat16 a bfloat16 matmul converts every weight first, so
    float32 there.
    """
    from target_worker.loader import cpu_has_bf16_dot

    return torch.bfloat16 if cpu_has_bf16_dot() else torch.float32


def resolve_head_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    """``dtype`` as a torch dtype: None or ``"auto"`` is `default_head_dtype`.

    Raises:
        ValueError: naming the value unless float32, bfloat16 or float16.
    """
    if dtype is None or dtype == "auto":
        return default_head_dtype()
    if isinstance(dtype, str):
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                 "float16": torch.float16}.get(dtype, dtype)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype: the EAGLE-3 head's weights must be auto, float32, bfloat16 "
                         f"or float16, got {dtype!r}")
    return dtype


class Eagle3Session:
    """One request's EAGLE-3 drafting state: the head's KV cache over committed positions.

    Implements `Drafter` as `drafter_worker.eagle.EagleSession` does: ``propose(history,
    target_hidden, max_len)`` takes the target's rows (``[rows, 3 * Ht]``, the layers of
    `hidden_layers` side by side in ascending order) committed since its previous call
    (extending its cache) or every row of the history (``len(history) - 1`` rows: it starts
    over); after drafting the cache is rolled back to the committed positions.

    Raises (from ``propose``):
        NeedsResync: rows that neither continue the session nor cover the whole history.
        ValueError: rows of another width (the target is not capturing `hidden_layers`).
    """

    wants_hidden = True

    def __init__(self, drafter: Eagle3Drafter, sampling: DraftSamplingParams | None = None,
                 seed: int = 0):
        self.drafter = drafter
        # Drafts are the head's argmax whatever the sampling (see `_draft`): the request's
        # sampling and seed are taken for the `Drafter` session interface and not used.
        del sampling, seed
        self.max_draft_len = drafter.max_draft_len
        self.cache = drafter.head.new_cache()
        self.tokens: list[int] = []  # history whose pairs (row t, x_{t+1}) are in the cache
        self._hidden: torch.Tensor | None = None  # pre-norm output at the last pair, [1, H]

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """The target layers whose rows this session reads (capture-before, ascending)."""
        return self.drafter.hidden_layers

    @property
    def capabilities(self) -> DrafterCapabilities:
        return self.drafter.capabilities

    def reset(self) -> None:
        self.cache.truncate(0)
        self.tokens = []
        self._hidden = None

    def _ingest(self, history: Sequence[int], rows: torch.Tensor) -> None:
        head = self.drafter.head
        n = len(history)
        width = 3 * head.config.target_hidden_size
        if rows.dim() != 2 or rows.shape[1] != width:
            raise ValueError(f"hidden rows must be [rows, {width}] (target layers "
                             f"{list(self.hidden_layers)} side by side: "
                             f"Decoder.set_capture_layers), got {tuple(rows.shape)}")
        try:
            if not rows_continue(self.tokens, history, rows.shape[0]):
                self.reset()  # every row of the history: start over
        except NeedsResync:
            self.reset()
            raise
        if rows.shape[0] == 0:
            return
        start = self.cache.seq_len  # == len(self.tokens) - 1, or 0 when fresh
        nxt = torch.as_tensor(list(history[start + 1: n]), dtype=torch.long)
        with torch.inference_mode():
            out = head.step(head.encode_target(rows.float()), nxt, self.cache)
        self._hidden = out[-1:]
        self.tokens = list(history)

    def propose(self, history: Sequence[int], target_hidden: torch.Tensor | None,
                max_len: int) -> DraftBlock:
        """See the class docstring and `Drafter`. Empty block when there are no rows yet."""
        return self.propose_ahead(history, target_hidden, (), max_len)

    @torch.inference_mode()
    def propose_ahead(self, history: Sequence[int], target_hidden: torch.Tensor | None,
                      assumed: Sequence[int], max_len: int) -> DraftBlock:
        """`specd_core.draft.propose_ahead`: ingests the committed rows as `propose` does,
        then runs the head over ``assumed`` on its own outputs and drafts after them; the
        cache is rolled back to the committed positions afterwards."""
        if target_hidden is not None:
            self._ingest(history, target_hidden)
        elif list(history) != self.tokens:
            self.reset()
            return DraftBlock.empty()
        return self._draft(max_len, assumed)

    def _draft(self, max_len: int, assumed: Sequence[int] = ()) -> DraftBlock:
        """Up to ``max_len`` drafts after the committed tokens (+ ``assumed``)."""
        k = min(max_len, self.max_draft_len)
        if k <= 0 or self._hidden is None:
            return DraftBlock.empty()
        drafter, head = self.drafter, self.drafter.head
        vocab_ids = drafter.vocab_ids
        committed = self.cache.seq_len
        hidden = self._hidden
        tokens, dists = [], []
        reach = 1.0  # the head's estimate that every draft so far is accepted
        try:
            for token in assumed:
                hidden = head.step(hidden, torch.tensor([int(token)]), self.cache)
            for i in range(k):
                # The head's argmax at every temperature, reported as a point mass: the rule
                # then draws each position as plain sampling would (one uniform, inverse
                # CDF) and accepts iff the draw is the draft, so a seeded request's tokens
                # never depend on whether, how far or how late it drafted
                # (`specd_core.rule`); accepted with probability p(draft).
                logits = head.draft_logits(hidden)[0]
                j = int(torch.argmax(logits))
                reach *= float(torch.softmax(logits.float(), 0)[j])
                if reach < drafter.min_confidence:
                    break
                token = int(vocab_ids[j])
                dist = DraftDist.deterministic(token)
                tokens.append(token)
                dists.append(dist)
                if token in drafter.stop_token_ids or i == k - 1:
                    break
                hidden = head.step(hidden, torch.tensor([token]), self.cache)
        finally:
            self.cache.truncate(committed)  # roll back to the committed prefix
        return DraftBlock(tokens, dists)


class Eagle3Drafter:
    """EAGLE-3 drafter (see the module docstring), with per-request `Eagle3Session` s.

    The target must return, as its hidden rows, the residual streams entering
    `hidden_layers` (`target_worker.model.Decoder.set_capture_layers(drafter.hidden_layers)`;
    `coordinator.step.speculative.speculative_decode_with` sets it in process).

    Args:
        head: a loaded `Eagle3Head` with resolved ``aux_layers``.
        embed_weight: the target's embedding ``[V, H]`` (shared, not copied), for a head
            without its own embeddings; a head whose own table equals it drops its copy and
            shares it too (so `Eagle3Head.save` then writes none).
        max_draft_len: most tokens one proposal drafts.
        stop_token_ids: a drafted stop token ends the block.
        min_confidence: dynamic draft length (EAGLE-2): a block stops before the position
            where the product of the head's top probabilities falls below it; 0: off.
        dtype: the head's matmul weights (`Eagle3Head.set_weight_dtype`, applied to
            ``head``): ``"float32"``, ``"bfloat16"`` (or a torch dtype), or None / ``"auto"``:
            `default_head_dtype`. Activations, norms and the softmax stay float32 either way.

    Raises:
        ValueError: unresolved ``aux_layers``, a head without embeddings and no
            ``embed_weight`` (or one of another shape), max_draft_len < 1, min_confidence
            outside [0, 1], an unknown dtype.
    """

    wants_hidden = True

    def __init__(self, head: Eagle3Head, embed_weight: torch.Tensor | None = None,
                 max_draft_len: int = 6, stop_token_ids: Sequence[int] = (),
                 min_confidence: float = 0.0, dtype: str | torch.dtype | None = None):
        if head.config.aux_layers is None:
            raise ValueError("aux_layers: unresolved; load the head with the target's config "
                             "(load_eagle3(path, target_config)) or resolve_aux_layers(n)")
        if (head.has_own_embedding and embed_weight is not None
                and tuple(embed_weight.shape) == tuple(head.embed_tokens.weight.shape)
                and torch.equal(head.embed_tokens.weight, embed_weight.detach().float())):
            head.embed_tokens = None  # a copy of the target's table (speculators saves one)
        if not head.has_own_embedding:
            if embed_weight is None:
                raise ValueError("embed_tokens: the head has none; pass the target's "
                                 "embedding (embed_weight)")
            head.set_target_embedding(embed_weight)
        if max_draft_len < 1:
            raise ValueError(f"max_draft_len must be >= 1, got {max_draft_len}")
        if not 0.0 <= min_confidence <= 1.0:
            raise ValueError(f"min_confidence must be in [0, 1], got {min_confidence}")
        self.head = head.set_weight_dtype(resolve_head_dtype(dtype)).eval()
        self.vocab_ids = head.vocab_ids
        self.max_draft_len = int(max_draft_len)
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        self.min_confidence = float(min_confidence)
        self._default = Eagle3Session(self)

    @classmethod
    def for_target(cls, decoder, path: str | os.PathLike | None = None, **kwargs
                   ) -> Eagle3Drafter:
        """A drafter for ``decoder`` (a `target_worker.Decoder`): the head at ``path``
        (None: `DEFAULT_EAGLE3_HEAD`) validated against its config, sharing its embedding
        when the head has none. ``kwargs``: as the constructor.

        Raises:
            FileNotFoundError, ValueError: as `load_eagle3` and the constructor.
        """
        head, _ = load_eagle3(path, decoder.config)
        return cls(head, decoder.embed_tokens.weight, **kwargs)

    @classmethod
    def for_model(cls, model: str | os.PathLike | None = None,
                  path: str | os.PathLike | None = None, **kwargs) -> Eagle3Drafter:
        """A drafter for the target ``model`` (a `target_worker.load_model` source) without
        loading it: its config (`target_worker.loader.model_config`) and, for a head without
        embeddings, its embedding table only (`drafter_worker.eagle.load_target_head_weights`).

        Raises:
            FileNotFoundError, ValueError: as `load_eagle3`, the model loader and the
                constructor.
        """
        from target_worker.loader import model_config

        from ..eagle import load_target_head_weights

        head, _ = load_eagle3(path, model_config(model))
        embed = None if head.has_own_embedding else load_target_head_weights(model)[0]
        return cls(head, embed, **kwargs)

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """The target layers the head reads (capture-before, ascending): what the target's
        ``set_capture_layers`` must be given."""
        return tuple(self.head.config.aux_layers or ())

    @property
    def capabilities(self) -> DrafterCapabilities:
        """Conditions on hidden rows, samples its drafts, one session per request."""
        return DrafterCapabilities(wants_hidden=True, max_draft_len=self.max_draft_len,
                                   sessions=True, samples=False,
                                   hidden_layers=self.hidden_layers)

    def session(self, sampling: DraftSamplingParams | None = None, seed: int = 0
                ) -> Eagle3Session:
        """A fresh per-request session (own KV cache, own seeded generator)."""
        return Eagle3Session(self, sampling, seed)

    def propose(self, history: Sequence[int], target_hidden: torch.Tensor | None,
                max_len: int) -> DraftBlock:
        """`Drafter.propose` on the implicit greedy session."""
        return self._default.propose(history, target_hidden, max_len)


class SuffixThenEagle3:
    """Suffix decoding's draft when it has one, EAGLE-3's otherwise (``--drafter
    eagle3+suffix``), as `drafter_worker.eagle.LookupThenEagle` combines prompt lookup with
    EAGLE-1.

    The EAGLE-3 session ingests every hidden row either way, so its KV cache stays current;
    its draft loop runs only when the suffix trees propose nothing. Suffix drafts are point
    masses and so are EAGLE-3's, so mixing them per step stays lossless and coupled.
    Finished outputs go to the suffix drafter's cross-request cache (`remember`).
    """

    wants_hidden = True

    def __init__(self, suffix, eagle: Eagle3Drafter, _suffix=None, _eagle=None):
        self.suffix = suffix
        self.eagle = eagle
        self.max_draft_len = max(getattr(suffix, "max_draft_len", 0) or 0,
                                 getattr(eagle, "max_draft_len", 0) or 0)
        self._suffix = _suffix if _suffix is not None else suffix
        self._eagle = _eagle if _eagle is not None else eagle

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """EAGLE-3's target layers (`Eagle3Drafter.hidden_layers`)."""
        return self.eagle.hidden_layers

    @property
    def capabilities(self) -> DrafterCapabilities:
        """EAGLE-3's, with the longer cap and the suffix drafter's cross-request cache."""
        return DrafterCapabilities(wants_hidden=True, max_draft_len=self.max_draft_len or None,
                                   sessions=True, samples=False, hidden_layers=self.hidden_layers,
                                   remembers=self.suffix.capabilities.remembers)

    def session(self, sampling: DraftSamplingParams | None = None, seed: int = 0,
                partition: str = "") -> SuffixThenEagle3:
        """A per-request combined drafter: its own suffix session (``partition``'s cache)
        and EAGLE-3 session."""
        return SuffixThenEagle3(self.suffix, self.eagle,
                                _suffix=self.suffix.session(partition=partition),
                                _eagle=self.eagle.session(sampling, seed))

    def remember(self, outputs, partitions=None) -> None:
        """Finished outputs for the suffix drafter's cache (`SuffixDrafter.remember`)."""
        self.suffix.remember(outputs, partitions)

    def stats(self) -> dict:
        """The suffix drafter's counters (`SuffixDrafter.stats`)."""
        return self.suffix.stats()

    def propose(self, history: Sequence[int], target_hidden: torch.Tensor | None,
                max_len: int) -> DraftBlock:
        block = self._suffix.propose(history, None, max_len)
        if len(block):
            self._eagle.propose(history, target_hidden, 0)  # ingest rows only
            return block
        return self._eagle.propose(history, target_hidden, max_len)

    def propose_ahead(self, history: Sequence[int], target_hidden: torch.Tensor | None,
                      assumed: Sequence[int], max_len: int) -> DraftBlock:
        """`specd_core.draft.propose_ahead`: the suffix drafter's run-ahead when it drafts,
        else EAGLE-3's (the EAGLE-3 session ingests the committed rows either way)."""
        block = propose_ahead(self._suffix, history, None, assumed, max_len)
        if len(block):
            self._eagle.propose(history, target_hidden, 0)  # ingest rows only
            return block
        return propose_ahead(self._eagle, history, target_hidden, assumed, max_len)
