"""The target side of the speculative decoding service: slots, KV caches, packed verification.

A `TargetEngine` owns one `KvCache` per *slot* (one running request) and turns target logits
into the compact rows the coordinator's accept/reject rule consumes (`specd_core.rule`), so
only argmax ints or sparse probability rows cross the process boundary, never ``[n, vocab]``
logits. Each slot also keeps the token ids its cache holds and its prompt length, which is all
the penalties need: the coordinator never ships a request's history.

All verify blocks and prefill chunks of a step run as one `Decoder.forward_packed` call
(`TargetEngine.step`), so every weight matrix is read once per step however many requests are
active or prefilling. Pure torch: the Ray actor
(`target_worker.actor`) wraps it.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch

from specd_core.choice import MeasuredChoice
from specd_core.grammar import apply_token_bitmask, bitmask_width
from specd_core.logprobs import commit_candidates, row_logprobs
from specd_core.rule import compact_rows, target_rows
from specd_core.step import PrefillItem, StepOutput, VerifyItem

from .config import ModelConfig
from .invariant import one_thread
from .model import DEFAULT_CACHE_CAPACITY, Decoder, KvCache

__all__ = ["SlotsExhausted", "TargetEngine"]


class SlotsExhausted(RuntimeError):
    """Every slot of the engine is in use (the caller admits the request later)."""


#: Positions the warm slots of an engine keep by default for prefix reuse (SmolLM2-135M:
#: 46 KB of float32 keys and values per position, so ~1.5 GB).
DEFAULT_PREFIX_CACHE_TOKENS = 32768

#: Steps feeding at least this many tokens are prompt-sized: `TargetEngine` chooses their
#: threads apart from smaller steps' and compares their costs per token (big matmuls scale
#: with threads: SmolLM2 here, a 512-token prefill 415 tok/s on 1 thread, 920 on 2).
#: Smaller steps (decode, verify blocks) are compared per step: their cost grows little
#: with their rows (oneDNN's packed weights: 1 row 37 ms, 8 rows 51 ms; see
#: `scripts/verify_cost.py`), so a mix of sizes barely skews the comparison, where a short
#: prompt's prefill among them would.
PREFILL_THREADS_MIN_TOKENS = 64

#: How much cheaper a `TargetEngine`'s ``fallback_threads`` must measure than the process's
#: threads before steps use them (`ThreadChooser`'s ``margin``).
THREAD_CHOICE_MARGIN = 0.15

#: How much more than its least the process's thread count must come to cost before a
#: `TargetEngine` tries its ``fallback_threads`` again (`ThreadChooser`'s ``retry_above``).
THREAD_RETRY_ABOVE = 0.3


class ThreadChooser(MeasuredChoice):
    """Chooses torch threads for one kind of step from their measured seconds per token (or
    per step: `record`'s ``tokens``): a `specd_core.choice.MeasuredChoice` over thread counts,
    the process's count first.

    More threads pay only while every thread has a core: OpenMP threads spin-wait for each
    other, so beside one busy process 2 threads on 2 cores ran SmolLM2 prompt chunks 2x
    slower than 1 thread (4 x 256 tokens: 4.58 s vs 2.20 s), where on a quiet machine they
    ran 1.74x faster (1.30 s vs 2.26 s). So each option's cost is measured (an EMA of
    seconds per token over the steps that used it) and the cheapest is used, every
    ``explore_every``-th step trying another so a machine that got busier or quieter is
    followed.

    An option's first ``warmup`` steps are not booked: a step shape's first calls pay
    one-off costs (MKL's kernel set-up, waking threads), which measured up to 2x a warm
    step's time and, booked, kept a step size on its slower option for a whole run. The
    first option is preferred: another replaces it only while measured ``margin`` cheaper,
    and once each option is measured, the others are tried again only while the first
    costs ``retry_above`` more than the least it has cost (the machine may have got busy)
    or while another is in use (it may have got quiet). Without that, step-to-step noise
    (~10%) and exploring put 28% of a served run's decode steps on one thread where two
    were 1.27x faster; a collapse beside a busy process is 2-100x. Each exploration that
    leaves the best option as it was doubles the steps to the next one, up to
    ``max_explore_every``: beside a busy process, where the full count costs 10x, trying it
    every 12th step would cost 1.75x on average.

    Args:
        options: the thread counts to choose among (distinct, each >= 1), preferred first.
        explore_every: one step in this many tries an option other than the best.
        alpha: the EMA weight of a new measurement.
        warmup: steps per option run before its times count.
        margin: how much cheaper (a fraction) another option must measure than the first.
        retry_above: the first option's cost over its least (a fraction) above which the
            others are explored again; None: always explore.
        max_explore_every: the most steps between explorations once they keep confirming
            the best (None: ``explore_every``, no back-off).
    """

    def __init__(self, options: Sequence[int], explore_every: int = 12,
                 alpha: float = 0.3, warmup: int = 1, margin: float = 0.0,
                 retry_above: float | None = None,
                 max_explore_every: int | None = None) -> None:
        super().__init__(options, explore_every=explore_every, alpha=alpha, warmup=warmup,
                         margin=margin, retry_above=retry_above,
                         max_explore_every=max_explore_every)


class _Slot:
    __slots__ = ("cache", "tokens", "num_prompt_tokens", "offset", "owned", "partition")

    def __init__(self, cache: KvCache, owned: bool = True, partition: str = "") -> None:
        self.cache = cache
        #: Token ids at cache positions [offset, cache.seq_len), kept equal in length to them;
        #: positions before ``offset`` are context the slot was given (`TargetEngine.adopt`)
        #: or that its prefill started after, whose ids it does not know.
        self.tokens: list[int] = []
        self.num_prompt_tokens = 0
        self.offset = cache.seq_len
        #: False for a caller's cache (`TargetEngine.adopt`): never kept warm for reuse.
        self.owned = owned
        #: The cross-request partition it was allocated in: warm, it is found only there.
        self.partition = partition

    def start(self, start_pos: int) -> None:
        """Keeps the first ``start_pos`` positions as context and forgets every token id."""
        self.cache.truncate(start_pos)
        self.tokens.clear()
        self.offset = start_pos

    def truncate(self, length: int) -> None:
        self.cache.truncate(length)
        del self.tokens[length - self.offset:]


def _check_partition(partition) -> None:
    if not isinstance(partition, str):
        raise TypeError(f"partition must be a str, got {type(partition).__name__}")


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    return int(diff[0]) if diff.size else n


class TargetEngine:
    """Slots of per-request KV caches over one `Decoder`; every call is one packed forward.

    A target step (`step`) feeds verify blocks and prefill chunks of several requests in one
    `Decoder.forward_packed`, so every weight matrix is read once per step however many
    requests are active or prefilling.

    Prefix reuse (after vLLM's automatic prefix caching and SGLang's RadixAttention, on whole
    slots): a freed slot's cache stays *warm* with the token ids it holds, in the partition it
    was allocated in. `allocate_prefix` gives a new request the positions of the warm entry
    (of its partition) sharing the longest prefix with its prompt, so its prefill computes
    only the rest. Taking never destroys what others could still reuse: an entry holding
    more than the shared prefix stays warm (marked recently used) and the request gets a
    copy of the shared span (`KvCache.prefix_copy`, bitwise the same); only an entry wholly
    a prefix of the prompt is taken, and it comes back as a superset when the slot is freed.
    A freed slot whose tokens extend a warm entry replaces it, and one a warm entry already
    holds is not kept, so the memory goes to distinct content. The least recently used
    entries are evicted once the warm entries hold more than ``prefix_cache_tokens``
    positions (one longer than that is never kept).

    Not thread-safe: one caller (the actor's method loop) at a time.

    Attributes:
        decoder: the target model.
        max_slots: the most requests held at once.
        prefix_cache_tokens: positions warm slots may keep (0: prefix reuse off).
        fallback_threads: torch threads a step may run on instead of the process's: each
            step runs on the process's threads unless `ThreadChooser` measures these
            `THREAD_CHOICE_MARGIN` cheaper for steps of its kind (prompt-sized or not:
            `PREFILL_THREADS_MIN_TOKENS`); more threads pay on a quiet machine and collapse
            beside a busy process. None: always the process's.
        invariance: `Decoder.make_batch_invariant`'s report when the engine was built with
            ``batch_invariant`` (the default): each row then has the same bits whatever
            the step holds (verify blocks, prompt chunks, other requests, thread counts),
            and so have the rows the rule gets (computed on one thread: a one-row sum over
            the vocabulary would split across threads where a many-row sum does not).
            None without.
        stats: counters for metrics: ``forward_calls``, ``prefill_calls`` and
            ``verify_calls`` (calls carrying a prefill chunk / a verify block),
            ``tokens_fed`` (all segments' tokens), ``prefill_tokens``, ``forward_seconds``
            (wall time inside the decoder's forward, float seconds), ``rows_seconds``
            (turning logits into rows), ``prefix_queries`` / ``prefix_hits`` (allocations
            that looked for / reused a warm prefix), ``prefix_query_tokens`` /
            ``prefix_hit_tokens`` (prompt tokens looked up / reused), ``prefix_copies``
            (hits that copied the shared span of an entry that stays warm); and gauges of
            the warm set now: ``warm_entries``, ``warm_positions`` and ``warm_bytes`` (the
            keys and values those positions hold, `KvCache.position_bytes` each).
    """

    def __init__(self, decoder: Decoder, max_slots: int = 64,
                 prefix_cache_tokens: int = DEFAULT_PREFIX_CACHE_TOKENS,
                 fallback_threads: int | None = None, batch_invariant: bool = True) -> None:
        if isinstance(max_slots, bool) or not isinstance(max_slots, int) or max_slots < 1:
            raise ValueError(f"max_slots must be a positive int, got {max_slots!r}")
        if (isinstance(prefix_cache_tokens, bool) or not isinstance(prefix_cache_tokens, int)
                or prefix_cache_tokens < 0):
            raise ValueError(
                f"prefix_cache_tokens must be an int >= 0, got {prefix_cache_tokens!r}")
        if fallback_threads is not None and (
                isinstance(fallback_threads, bool) or not isinstance(fallback_threads, int)
                or fallback_threads < 1):
            raise ValueError(f"fallback_threads must be a positive int, got {fallback_threads!r}")
        self.decoder = decoder
        #: `Decoder.make_batch_invariant`'s report (None: not batch invariant).
        self.invariance: dict | None = None
        if batch_invariant:
            threads = torch.get_num_threads()
            counts = (threads,) if fallback_threads is None else (threads, fallback_threads)
            self.invariance = decoder.make_batch_invariant(counts)
        self.max_slots = max_slots
        self.prefix_cache_tokens = prefix_cache_tokens
        self.fallback_threads = fallback_threads
        #: Prompt-sized (True) or not -> its chooser, made at the first such step (the
        #: process's threads are known then).
        self.thread_choosers: dict[bool, ThreadChooser] = {}
        self._slots: dict[int, _Slot] = {}
        #: Freed slots kept for prefix reuse, least recently freed first.
        self._warm: OrderedDict[int, _Slot] = OrderedDict()
        self._warm_ids = itertools.count()
        self._warm_positions = 0
        self._warm_bytes = 0
        self.stats: dict[str, float] = {
            "forward_calls": 0,
            "prefill_calls": 0,
            "verify_calls": 0,
            "tokens_fed": 0,
            "prefill_tokens": 0,
            "forward_seconds": 0.0,
            "rows_seconds": 0.0,
            "prefix_queries": 0,
            "prefix_hits": 0,
            "prefix_query_tokens": 0,
            "prefix_hit_tokens": 0,
            "prefix_copies": 0,
            "warm_entries": 0,
            "warm_positions": 0,
            "warm_bytes": 0,
        }

    @property
    def config(self) -> ModelConfig:
        return self.decoder.config

    @property
    def used_slots(self) -> int:
        return len(self._slots)

    @property
    def warm_positions(self) -> int:
        """Positions held by warm slots (kept for prefix reuse)."""
        return self._warm_positions

    @property
    def warm_bytes(self) -> int:
        """Bytes of the keys and values at the warm slots' positions."""
        return self._warm_bytes

    def warm_entries(self, partition: str | None = None) -> list[tuple[str, list[int]]]:
        """``(partition, token ids)`` of each warm entry (of ``partition`` only, unless
        None), least recently used first: for tests and diagnostics."""
        return [(w.partition, list(w.tokens)) for w in self._warm.values()
                if partition is None or w.partition == partition]

    def _free_id(self) -> int:
        for slot in range(self.max_slots):
            if slot not in self._slots:
                return slot
        raise SlotsExhausted(f"all {self.max_slots} target slots are in use")

    def allocate(self, partition: str = "") -> int:
        """Reserves the lowest free slot id in ``[0, max_slots)`` with an empty cache; freed,
        it stays warm in ``partition`` (see `allocate_prefix`).

        Raises:
            SlotsExhausted: every slot is in use.
            TypeError: ``partition`` is not a str.
        """
        _check_partition(partition)
        slot = self._free_id()
        # Cache memory is allocated lazily by the OS as positions are written.
        self._slots[slot] = _Slot(self.decoder.new_cache(), partition=partition)
        return slot

    def allocate_prefix(self, tokens: Sequence[int], partition: str = "") -> tuple[int, int]:
        """Reserves the lowest free slot id for a prompt of ``tokens``, starting from the warm
        entry of ``partition`` sharing its longest prefix when there is one.

        That entry is never cut short: when it holds more positions than the shared prefix,
        the slot gets a copy of the shared span (`KvCache.prefix_copy`; the entry stays warm,
        now the most recently used); when it is wholly a prefix of the prompt, the slot takes
        it (freed, the slot holds a superset of it again).

        Args:
            tokens: the prompt's token ids. One token or none looks nothing up (a plain
                slot, as `allocate`, that goes warm in ``partition`` when freed).
            partition: an opaque cross-request partition (the coordinator's tenant and
                ``cache_salt``; "" the shared default): warm entries are looked up only in
                it, and the slot stays warm in it when freed.

        Returns:
            ``(slot, reused)``: the slot holds the prompt's first ``reused`` positions, at
            most ``len(tokens) - 1`` (the last prompt position is always computed: its
            logits sample the first token). Feed the rest as a `PrefillItem` with ``offset
            = reused``. ``reused`` is 0 with prefix reuse off or no shared prefix.

        Raises:
            SlotsExhausted: every slot is in use.
            TypeError: ``partition`` is not a str.
        """
        _check_partition(partition)
        slot = self._free_id()
        best, reused, whole = None, 0, False
        if self.prefix_cache_tokens and len(tokens) > 1:
            self.stats["prefix_queries"] += 1
            self.stats["prefix_query_tokens"] += len(tokens)
            for key, warm in self._warm.items():
                if warm.partition != partition:
                    continue
                shared = common_prefix_len(warm.tokens, tokens)
                n = min(shared, len(tokens) - 1)
                # Ties go to an entry that can be taken (no copy), then the most recent.
                if n and (n, shared == len(warm.tokens)) >= (reused, whole):
                    best, reused, whole = key, n, shared == len(warm.tokens)
        if best is None:
            self._slots[slot] = _Slot(self.decoder.new_cache(), partition=partition)
            return slot, 0
        warm = self._warm[best]
        if whole:
            del self._warm[best]
            self._count_warm(warm, -1)
            warm.truncate(reused)
            held = warm
        else:
            self._warm.move_to_end(best)
            room = min(warm.cache.max_seq_len, max(DEFAULT_CACHE_CAPACITY, len(tokens)))
            held = _Slot(warm.cache.prefix_copy(reused, capacity=room), partition=partition)
            held.offset = 0
            held.tokens = warm.tokens[:reused]
            self.stats["prefix_copies"] += 1
        self._slots[slot] = held
        self.stats["prefix_hits"] += 1
        self.stats["prefix_hit_tokens"] += reused
        return slot, reused

    def adopt(self, cache: KvCache) -> int:
        """Reserves the lowest free slot over an existing ``cache`` of this decoder (its
        positions kept as context, e.g. a caller's warm cache); a prefill at ``start_pos ==
        cache.seq_len`` then continues it. `free` drops the slot, never the cache.

        Raises:
            SlotsExhausted: every slot is in use.
        """
        slot = self._free_id()
        self._slots[slot] = _Slot(cache, owned=False)
        return slot

    def free(self, slot: int) -> None:
        """Releases ``slot``. Its cache stays warm for prefix reuse, in the partition it was
        allocated in, when the engine keeps some, it knows every token id the cache holds
        and a warm entry of that partition does not hold them already (else it is dropped).
        Warm entries it extends are dropped; then the least recently used entries are
        evicted while they hold more than ``prefix_cache_tokens`` positions.

        Raises:
            ValueError: ``slot`` is not allocated.
        """
        held = self._slot(slot)
        del self._slots[slot]
        n = len(held.tokens)
        if not (self.prefix_cache_tokens and held.owned and held.offset == 0 and held.tokens
                and n <= self.prefix_cache_tokens):
            return
        for key, warm in list(self._warm.items()):
            if warm.partition != held.partition:
                continue
            m = len(warm.tokens)
            shared = common_prefix_len(warm.tokens, held.tokens)
            if m <= n and shared == m:  # the freed slot holds all of it and more
                del self._warm[key]
                self._count_warm(warm, -1)
            elif shared == n:  # it holds all the freed slot does
                self._warm.move_to_end(key)
                return
        self._warm[next(self._warm_ids)] = held
        self._count_warm(held, 1)
        while self._warm_positions > self.prefix_cache_tokens:
            _, old = self._warm.popitem(last=False)
            self._count_warm(old, -1)

    def _count_warm(self, warm: _Slot, sign: int) -> None:
        """Books ``warm`` entering (``sign`` 1) or leaving (-1) the warm set."""
        self._warm_positions += sign * len(warm.tokens)
        self._warm_bytes += sign * len(warm.tokens) * warm.cache.position_bytes
        self.stats["warm_entries"] = len(self._warm)
        self.stats["warm_positions"] = self._warm_positions
        self.stats["warm_bytes"] = self._warm_bytes

    def slot_length(self, slot: int) -> int:
        """Positions held in ``slot``'s cache. Raises ValueError for an unknown slot."""
        return self._slot(slot).cache.seq_len

    def rollback(self, slot: int, length: int) -> None:
        """Keeps the first ``length`` positions of ``slot``.

        Raises:
            ValueError: unknown slot, or ``length`` outside ``[0, slot_length(slot)]``.
        """
        self._slot(slot).truncate(length)

    def prefill(self, items: Sequence[PrefillItem | VerifyItem]) -> list[StepOutput]:
        """`step` (the name the prefill-only calls of the service and its tests use)."""
        return self.step(items)

    def verify(self, items: Sequence[PrefillItem | VerifyItem]) -> list[StepOutput]:
        """`step` (the name the verify calls of the service and its tests use)."""
        return self.step(items)

    def step(self, items: Sequence[PrefillItem | VerifyItem]) -> list[StepOutput]:
        """Feeds every item in ONE packed forward: verify blocks and prefill chunks alike.

        A `VerifyItem` first rolls its slot back to ``start_pos`` (discarding the previous
        step's rejected positions) and feeds ``[anchor, *draft]`` there; row ``i`` of its
        rows follows the slot's tokens before ``start_pos`` + the anchor + ``draft[:i]``,
        penalties counted over the tokens after the slot's prompt.

        A `PrefillItem` feeds a prompt chunk at ``start_pos + offset``: with ``offset`` 0 the
        slot first keeps only its first ``start_pos`` positions (context the prompt
        continues), else it must hold exactly ``start_pos + offset``. Penalties count the
        prompt (all chunks so far) as the request's prompt and the context not at all.

        Hidden rows: the items that ask for them (``want_hidden``) name the same
        ``hidden_layers`` (the step's drafter's), and the forward returns those rows
        (`Decoder.set_capture_layers`: ``()`` the final-norm rows, else the residual streams
        entering the layers); the decoder's own setting is restored after the forward.

        Returns:
            Per item, in order, a `StepOutput`: ``len(tokens)`` rows for a verify block; the
            last prompt position's row for a prefill's ``last`` chunk; rows None for an
            earlier chunk. Hidden rows of every fed position when asked. Raw log
            probabilities (`specd_core.logprobs.RowLogprobs`) when the item asks: every row
            of a verify block; every row of a chunk scoring its prompt, else the ``last``
            chunk's last row. None per item when the decoder returns no logits (a
            tensor-parallel shard on a rank other than 0, `target_worker.tp`).

        Raises:
            ValueError: an unknown or repeated slot, empty ``tokens``, a ``start_pos``
                beyond the slot's length (or, verifying, before its prompt), a chunk that
                does not continue its slot, a chunk scoring its prompt without a valid
                ``next_token`` (when not ``last``), a token id outside the vocabulary, the
                context exceeded, or ``hidden_layers`` the decoder does not have (outside
                ``[0, n_layers]``, repeated) or that differ among the items wanting hidden
                rows. Nothing is changed then.
        """
        if not items:
            return []
        slots = self._check_items(items)
        capture = self._capture_layers(items)
        for item, slot in zip(items, slots, strict=True):
            if isinstance(item, VerifyItem):
                slot.truncate(item.start_pos)
            elif item.offset == 0:
                slot.start(item.start_pos)
        results = self._forward(
            [(list(item.tokens), _feed_pos(item), slot.cache)
             for item, slot in zip(items, slots, strict=True)],
            # A prefill needs only its last row's logits, unless it scores its prompt.
            [isinstance(item, PrefillItem) and item.prompt_logprobs is None
             for item in items],
            capture,
        )
        results = _logits_to_host(results)
        if any(isinstance(item, PrefillItem) for item in items):
            self.stats["prefill_calls"] += 1
        if any(isinstance(item, VerifyItem) for item in items):
            self.stats["verify_calls"] += 1
        t0 = time.perf_counter()
        with one_thread():
            outputs = self._outputs(items, slots, results)
        self.stats["rows_seconds"] += time.perf_counter() - t0
        return outputs

    def _outputs(self, items, slots, results) -> list[StepOutput | None]:
        """Per item, its `StepOutput` from its forward results (see `step`)."""
        outputs = []
        for item, slot, (logits, hidden) in zip(items, slots, results, strict=True):
            tokens = [int(t) for t in item.tokens]
            if isinstance(item, PrefillItem):
                self.stats["prefill_tokens"] += len(tokens)
                slot.tokens.extend(tokens)
                slot.num_prompt_tokens = item.offset + len(tokens)
                if logits is None:  # a tensor-parallel rank other than 0: rank 0 answers
                    outputs.append(None)
                elif not item.last:
                    outputs.append(StepOutput(None, _own(hidden, item.want_hidden),
                                              _prompt_logprobs(item, logits, tokens)))
                else:
                    rows = compact_rows(target_rows(_masked(logits[-1:], item.mask),
                                                    item.sampling, slot.tokens,
                                                    slot.num_prompt_tokens))
                    outputs.append(StepOutput(rows, _own(hidden, item.want_hidden),
                                              _prompt_logprobs(item, logits, tokens, rows)))
                continue
            if logits is None:
                slot.tokens.extend(tokens)
                outputs.append(None)
                continue
            # History = committed tokens + the anchor; the draft is the block rows follow.
            # Only penalties read the history: skip copying a long context when none is set.
            history = [*slot.tokens, tokens[0]] if item.sampling.has_penalties else tokens[:1]
            rows = compact_rows(target_rows(_masked(logits, item.mask), item.sampling, history,
                                            slot.num_prompt_tokens, tokens[1:]))
            slot.tokens.extend(tokens)
            logprobs = None
            if item.logprobs is not None:
                candidates, full = commit_candidates(rows, tokens[1:])
                logprobs = row_logprobs(logits, item.logprobs, candidates, full)
            outputs.append(StepOutput(rows, _own(hidden, item.want_hidden), logprobs))
        return outputs

    def _slot(self, slot: int) -> _Slot:
        try:
            return self._slots[slot]
        except (KeyError, TypeError):
            raise ValueError(f"target slot {slot!r} is not allocated") from None

    def _check_items(self, items: Sequence[PrefillItem | VerifyItem]) -> list[_Slot]:
        """The items' slots, after checking every item can be fed (so a bad item changes
        nothing, not even the rollback of the good ones)."""
        slots, seen = [], set()
        vocab, context = self.config.vocab_size, self.config.max_seq_len
        for item in items:
            slot = self._slot(item.slot)
            if item.slot in seen:
                raise ValueError(f"target slot {item.slot} appears twice in one batch")
            seen.add(item.slot)
            if not item.tokens:
                raise ValueError(f"slot {item.slot}: no tokens to feed")
            start = _feed_pos(item)
            length = slot.cache.seq_len
            if isinstance(item, PrefillItem) and item.offset:
                if item.offset < 0 or start != length or slot.offset > item.start_pos:
                    raise ValueError(
                        f"slot {item.slot}: a prompt chunk at offset {item.offset} (position "
                        f"{start}) does not continue the slot's {length} positions")
            elif not 0 <= item.start_pos <= length:
                raise ValueError(
                    f"slot {item.slot}: start_pos {item.start_pos} is beyond its length "
                    f"{length}"
                )
            if isinstance(item, VerifyItem) and item.start_pos < slot.offset:
                raise ValueError(f"slot {item.slot}: start_pos {item.start_pos} is before its "
                                 f"prompt's start {slot.offset}")
            if (isinstance(item, PrefillItem) and item.prompt_logprobs is not None
                    and not item.last and not (
                        item.next_token is not None and 0 <= item.next_token < vocab)):
                raise ValueError(f"slot {item.slot}: a prompt chunk scoring its prompt needs "
                                 f"the next prompt token, got {item.next_token!r}")
            mask = item.mask
            if mask is not None and (
                    getattr(mask, "dtype", None) != np.int32
                    or tuple(mask.shape) != (1 if isinstance(item, PrefillItem)
                                             else len(item.tokens), bitmask_width(vocab))):
                raise ValueError(f"slot {item.slot}: grammar mask must be int32 "
                                 f"[rows, {bitmask_width(vocab)}], got "
                                 f"{getattr(mask, 'dtype', type(mask).__name__)} "
                                 f"{list(getattr(mask, 'shape', ()))}")
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

    def _capture_layers(self, items: Sequence[PrefillItem | VerifyItem]) -> tuple[int, ...]:
        """The layers whose residual streams this step returns as hidden rows (``()``: the
        final-norm rows, also when no item wants rows), after checking every item that wants
        rows names the same ones and the decoder has them.

        Raises:
            ValueError: naming ``hidden_layers``: items that differ, a layer outside
                ``[0, n_layers]``, a repeated one.
        """
        wanted = {tuple(item.hidden_layers) for item in items if item.want_hidden}
        if len(wanted) > 1:
            raise ValueError(f"hidden_layers differ among the items of one step: "
                             f"{sorted(list(w) for w in wanted)} (one forward captures one set)")
        layers = next(iter(wanted), ())
        if not layers:
            return ()
        n = self.config.n_layers
        bad = [i for i in layers if isinstance(i, bool) or not isinstance(i, int)
               or not 0 <= i <= n]
        if bad:
            raise ValueError(f"hidden_layers {list(layers)}: layer {bad[0]!r} is outside "
                             f"[0, {n}] (the target has {n} layers)")
        if len(set(layers)) != len(layers):
            raise ValueError(f"hidden_layers {list(layers)}: a layer repeats")
        return tuple(sorted(layers))

    def _forward(
        self, segments: list[tuple[list[int], int, KvCache]], last_only: list[bool],
        capture: tuple[int, ...] = (),
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        fed = sum(len(tokens) for tokens, _, _ in segments)
        threads = use = torch.get_num_threads()
        chooser = None
        prompt_sized = fed >= PREFILL_THREADS_MIN_TOKENS
        if self.fallback_threads is not None and self.fallback_threads != threads:
            chooser = self.thread_choosers.get(prompt_sized)
            if chooser is None:
                chooser = self.thread_choosers[prompt_sized] = ThreadChooser(
                    (threads, self.fallback_threads), margin=THREAD_CHOICE_MARGIN,
                    retry_above=THREAD_RETRY_ABOVE, max_explore_every=512)
            use = chooser.pick()
        t0 = time.perf_counter()
        # Always set, even to the same count: OpenMP's thread count is per calling thread,
        # and a caller on a thread that never set it would run every op on OMP_NUM_THREADS
        # (Ray sets 1). Target actors run all steps on one `ComputeThread` besides.
        torch.set_num_threads(use)  # ~0.2 us: the pool is kept
        # This step's hidden rows (checked in `_capture_layers`); the decoder's own setting
        # is put back, so an in-process caller's decoder is left as it was.
        before, self.decoder.capture_layers = self.decoder.capture_layers, capture
        try:
            results = self.decoder.forward_packed(segments, last_only)
        finally:
            self.decoder.capture_layers = before
            if use != threads:
                torch.set_num_threads(threads)
        seconds = time.perf_counter() - t0
        if chooser is not None:
            chooser.record(use, seconds, fed if prompt_sized else 1)
        self.stats["forward_seconds"] += seconds
        self.stats["forward_calls"] += 1
        self.stats["tokens_fed"] += fed
        return results


def _prompt_logprobs(item: PrefillItem, logits: torch.Tensor, tokens: list[int],
                     rows=None):
    """A prefill chunk's `RowLogprobs`, or None when it asked for none. With
    ``prompt_logprobs`` every row (``logits [n, vocab]``) scores the prompt token after it;
    on the ``last`` chunk (``rows``: its last row's target rows) the last row lists what it
    can commit instead, with ``logprobs`` alternatives (the wider of the two widths)."""
    want_prompt = item.prompt_logprobs is not None
    want_last = item.last and item.logprobs is not None
    if not (want_prompt or want_last):
        return None
    k = max(item.prompt_logprobs or 0, item.logprobs or 0)
    if not item.last:
        return row_logprobs(logits, k, [np.array([t]) for t in [*tokens[1:], item.next_token]])
    commits, full = commit_candidates(rows)
    if not want_prompt:
        return row_logprobs(logits[-1:], k, commits, full)
    if full:  # only the last row may commit any token: list it whole, not every row
        commits = [np.arange(logits.shape[-1])]
    return row_logprobs(logits, k, [np.array([t]) for t in tokens[1:]] + commits)


def _masked(logits: torch.Tensor, mask) -> torch.Tensor:
    """``logits`` with a constrained item's grammar bitmask applied (`specd_core.grammar`)."""
    return logits if mask is None else apply_token_bitmask(logits, mask)


def _feed_pos(item: PrefillItem | VerifyItem) -> int:
    """The absolute position ``item``'s first token is fed at."""
    return item.start_pos + item.offset if isinstance(item, PrefillItem) else item.start_pos


def _own(hidden: torch.Tensor, wanted: bool) -> torch.Tensor | None:
    # forward_packed returns views into one shared buffer: pickling a view ships the whole
    # storage, so copy out just this item's rows (to the host, from a device).
    if not wanted:
        return None
    return hidden.clone() if hidden.device.type == "cpu" else hidden.cpu()


def _logits_to_host(results: list[tuple[torch.Tensor | None, torch.Tensor]]
                    ) -> list[tuple[torch.Tensor | None, torch.Tensor]]:
    """``results`` with every item's logits on the host, copied from a device in one
    transfer: the step's one host sync, where its tokens leave the device (the rule, the
    sampling distributions and logprobs then run on the CPU as for a CPU target, on the
    same float32 logits). Hidden rows stay where they are (`_own` copies those asked for).
    CPU logits are returned as they are."""
    logits = [lg for lg, _ in results if lg is not None]
    if not logits or logits[0].device.type == "cpu":
        return results
    host = (logits[0] if len(logits) == 1 else torch.cat(logits)).cpu()
    out, row = [], 0
    for lg, hidden in results:
        if lg is None:
            out.append((None, hidden))
            continue
        out.append((host[row : row + lg.shape[0]], hidden))
        row += lg.shape[0]
    return out
