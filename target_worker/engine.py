"""The target side of the speculative decoding service: slots, KV caches, packed verification.

A `TargetEngine` owns one `KvCache` per *slot* (one running request) and turns target logits
into the compact rows the coordinator's accept/reject rule consumes (`specd_core.rule`), so
only argmax ints or sparse probability rows cross the process boundary, never ``[n, vocab]``
logits. Each slot also keeps the token ids its cache holds and its prompt length, which is all
the penalties need: the coordinator never ships a request's history.

All verifications of a step run as one `Decoder.forward_packed` call, so every weight matrix is
read once per step however many requests are active. Pure torch: the Ray actor
(`target_worker.actor`) wraps it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from specd_core.rule import compact_rows, target_rows
from specd_core.step import PrefillItem, StepOutput, VerifyItem

from .config import ModelConfig
from .model import Decoder, KvCache

__all__ = ["PrefillItem", "SlotsExhausted", "StepOutput", "TargetEngine", "VerifyItem"]


class SlotsExhausted(RuntimeError):
    """Every slot of the engine is in use (the caller admits the request later)."""


class _Slot:
    __slots__ = ("cache", "tokens", "num_prompt_tokens", "offset")

    def __init__(self, cache: KvCache) -> None:
        self.cache = cache
        #: Token ids at cache positions [offset, cache.seq_len), kept equal in length to them;
        #: positions before ``offset`` are context the slot was given (`TargetEngine.adopt`)
        #: or that its prefill started after, whose ids it does not know.
        self.tokens: list[int] = []
        self.num_prompt_tokens = 0
        self.offset = cache.seq_len

    def start(self, start_pos: int) -> None:
        """Keeps the first ``start_pos`` positions as context and forgets every token id."""
        self.cache.truncate(start_pos)
        self.tokens.clear()
        self.offset = start_pos

    def truncate(self, length: int) -> None:
        self.cache.truncate(length)
        del self.tokens[length - self.offset:]


class TargetEngine:
    """Slots of per-request KV caches over one `Decoder`, verified in packed batches.

    Not thread-safe: one caller (the actor's method loop) at a time.

    Attributes:
        decoder: the target model.
        max_slots: the most requests held at once.
        stats: counters for metrics: ``forward_calls``, ``prefill_calls``, ``verify_calls``,
            ``tokens_fed`` (all segments' tokens), ``forward_seconds`` (wall time inside the
            decoder's forward, float seconds), ``rows_seconds`` (turning logits into rows).
    """

    def __init__(self, decoder: Decoder, max_slots: int = 64) -> None:
        if isinstance(max_slots, bool) or not isinstance(max_slots, int) or max_slots < 1:
            raise ValueError(f"max_slots must be a positive int, got {max_slots!r}")
        self.decoder = decoder
        self.max_slots = max_slots
        self._slots: dict[int, _Slot] = {}
        self.stats: dict[str, float] = {
            "forward_calls": 0,
            "prefill_calls": 0,
            "verify_calls": 0,
            "tokens_fed": 0,
            "forward_seconds": 0.0,
            "rows_seconds": 0.0,
        }

    @property
    def config(self) -> ModelConfig:
        return self.decoder.config

    @property
    def used_slots(self) -> int:
        return len(self._slots)

    def allocate(self) -> int:
        """Reserves the lowest free slot id in ``[0, max_slots)`` with an empty cache.

        Raises:
            SlotsExhausted: every slot is in use.
        """
        for slot in range(self.max_slots):
            if slot not in self._slots:
                # Cache memory is allocated lazily by the OS as positions are written.
                self._slots[slot] = _Slot(self.decoder.new_cache())
                return slot
        raise SlotsExhausted(f"all {self.max_slots} target slots are in use")

    def adopt(self, cache: KvCache) -> int:
        """Reserves the lowest free slot over an existing ``cache`` of this decoder (its
        positions kept as context, e.g. a caller's warm cache); a prefill at ``start_pos ==
        cache.seq_len`` then continues it. `free` drops the slot, never the cache.

        Raises:
            RuntimeError: every slot is in use.
        """
        for slot in range(self.max_slots):
            if slot not in self._slots:
                self._slots[slot] = _Slot(cache)
                return slot
        raise RuntimeError(f"all {self.max_slots} target slots are in use")

    def free(self, slot: int) -> None:
        """Releases ``slot`` and its cache.

        Raises:
            ValueError: ``slot`` is not allocated.
        """
        self._slot(slot)
        del self._slots[slot]

    def slot_length(self, slot: int) -> int:
        """Positions held in ``slot``'s cache. Raises ValueError for an unknown slot."""
        return self._slot(slot).cache.seq_len

    def rollback(self, slot: int, length: int) -> None:
        """Keeps the first ``length`` positions of ``slot``.

        Raises:
            ValueError: unknown slot, or ``length`` outside ``[0, slot_length(slot)]``.
        """
        self._slot(slot).truncate(length)

    def prefill(self, items: Sequence[PrefillItem]) -> list[StepOutput]:
        """Starts a request in each item's slot in one packed forward: the slot keeps its
        first ``item.start_pos`` positions (0: discards all it held) and the prompt is fed
        after them; logits are computed for each prompt's last position only. Penalties
        count the prompt as the request's prompt and the context before it not at all.

        Returns:
            Per item, in order: rows for the last prompt position (1 row), hidden rows of
            every prompt position when asked. None per item when the decoder returns no
            logits (a tensor-parallel shard on a rank other than 0, `target_worker.tp`).

        Raises:
            ValueError: an unknown or repeated slot, an empty prompt, a ``start_pos`` beyond
                the slot's length, a token id outside the vocabulary or a prompt longer than
                the context. Nothing is changed then.
        """
        if not items:
            return []
        slots = self._check_items(items, [item.start_pos for item in items])
        for item, slot in zip(items, slots, strict=True):
            slot.start(item.start_pos)
        results = self._forward(
            [(list(item.tokens), item.start_pos, slot.cache)
             for item, slot in zip(items, slots, strict=True)],
            [True] * len(items),
        )
        self.stats["prefill_calls"] += 1
        outputs = []
        t0 = time.perf_counter()
        for item, slot, (logits, hidden) in zip(items, slots, results, strict=True):
            slot.tokens.extend(int(t) for t in item.tokens)
            slot.num_prompt_tokens = len(item.tokens)
            if logits is None:  # a tensor-parallel rank other than 0: rank 0 answers
                outputs.append(None)
                continue
            rows = target_rows(logits, item.sampling, slot.tokens, slot.num_prompt_tokens)
            outputs.append(StepOutput(compact_rows(rows), _own(hidden, item.want_hidden)))
        self.stats["rows_seconds"] += time.perf_counter() - t0
        return outputs

    def verify(self, items: Sequence[VerifyItem]) -> list[StepOutput]:
        """Verifies every item's ``[anchor, *draft]`` in ONE packed forward.

        Each slot is first rolled back to the item's ``start_pos``. Row ``i`` of an item's
        rows follows the slot's tokens before ``start_pos`` + the anchor + ``draft[:i]``, with
        penalties counted over the tokens after the slot's prompt.

        Returns:
            Per item, in order: ``len(tokens)`` rows, hidden ``[len(tokens), hidden_size]``
            when asked (None per item on a tensor-parallel rank other than 0, as `prefill`).

        Raises:
            ValueError: an unknown or repeated slot, empty ``tokens``, ``start_pos`` beyond
                the slot's length or before its prompt, a token id outside the vocabulary,
                or the context exceeded. Nothing is changed then.
        """
        if not items:
            return []
        slots = self._check_items(items, [item.start_pos for item in items])
        for item, slot in zip(items, slots, strict=True):
            if item.start_pos < slot.offset:
                raise ValueError(f"slot {item.slot}: start_pos {item.start_pos} is before its "
                                 f"prompt's start {slot.offset}")
        for item, slot in zip(items, slots, strict=True):
            slot.truncate(item.start_pos)
        results = self._forward(
            [
                (list(item.tokens), item.start_pos, slot.cache)
                for item, slot in zip(items, slots, strict=True)
            ],
            [False] * len(items),
        )
        self.stats["verify_calls"] += 1
        outputs = []
        t0 = time.perf_counter()
        for item, slot, (logits, hidden) in zip(items, slots, results, strict=True):
            tokens = [int(t) for t in item.tokens]
            if logits is None:  # a tensor-parallel rank other than 0: rank 0 answers
                slot.tokens.extend(tokens)
                outputs.append(None)
                continue
            # History = committed tokens + the anchor; the draft is the block rows follow.
            # Only penalties read the history: skip copying a long context when none is set.
            history = [*slot.tokens, tokens[0]] if item.sampling.has_penalties else tokens[:1]
            rows = target_rows(logits, item.sampling, history, slot.num_prompt_tokens,
                               tokens[1:])
            slot.tokens.extend(tokens)
            outputs.append(StepOutput(compact_rows(rows), _own(hidden, item.want_hidden)))
        self.stats["rows_seconds"] += time.perf_counter() - t0
        return outputs

    def _slot(self, slot: int) -> _Slot:
        try:
            return self._slots[slot]
        except (KeyError, TypeError):
            raise ValueError(f"target slot {slot!r} is not allocated") from None

    def _check_items(
        self, items: Sequence[PrefillItem | VerifyItem], starts: Sequence[int]
    ) -> list[_Slot]:
        """The items' slots, after checking every item can be fed (so a bad item changes
        nothing, not even the rollback of the good ones)."""
        slots, seen = [], set()
        vocab, context = self.config.vocab_size, self.config.max_seq_len
        for item, start in zip(items, starts, strict=True):
            slot = self._slot(item.slot)
            if item.slot in seen:
                raise ValueError(f"target slot {item.slot} appears twice in one batch")
            seen.add(item.slot)
            if not item.tokens:
                raise ValueError(f"slot {item.slot}: no tokens to feed")
            if not 0 <= start <= slot.cache.seq_len:
                raise ValueError(
                    f"slot {item.slot}: start_pos {start} is beyond its length "
                    f"{slot.cache.seq_len}"
                )
            bad = [t for t in item.tokens if not 0 <= int(t) < vocab]
            if bad:
                raise ValueError(
                    f"slot {item.slot}: token id {bad[0]} is outside the vocabulary [0, {vocab})"
                )
            if start + len(item.tokens) > context:
                raise ValueError(
                    f"slot {item.slot}: {start} + {len(item.tokens)} tokens exceeds the "
                    f"context of {context}"
                )
            slots.append(slot)
        return slots

    def _forward(
        self, segments: list[tuple[list[int], int, KvCache]], last_only: list[bool]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        t0 = time.perf_counter()
        results = self.decoder.forward_packed(segments, last_only)
        self.stats["forward_seconds"] += time.perf_counter() - t0
        self.stats["forward_calls"] += 1
        self.stats["tokens_fed"] += sum(len(tokens) for tokens, _, _ in segments)
        return results


def _own(hidden: torch.Tensor, wanted: bool) -> torch.Tensor | None:
    # forward_packed returns views into one shared buffer: pickling a view ships the whole
    # storage, so copy out just this item's rows.
    return hidden.clone() if wanted else None
