"""Per-request drafting state over one `Drafter`: what a drafter worker keeps between steps.

`DrafterSessions` holds, per request id, the drafter's view of the committed history (so a
caller ships only the new tokens) and, for a drafter with per-request state
(`DrafterCapabilities.sessions`), the request's own session of it. The view is append-only;
whenever a caller's ``known`` count disagrees with it the id is forgotten and the caller is
told to resync (resend the whole history), so a proposal always equals ``drafter.propose``
on the full committed history. The gRPC servicer (`drafter_worker.server.DrafterServicer`)
and the in-process adapter (`drafter_worker.local.LocalDrafter`) both use it.

Partitions: every proposal names the request's partition of the cross-request state (an
opaque string from the coordinator: its tenant and ``cache_salt``; "" shared). A drafter
with a cross-request cache (`DrafterCapabilities.remembers`) gets it when the request's
session is made (``drafter.session(sampling, seed, partition)``) and with every output
(``drafter.remember(outputs, partitions)``). The partition travels with every item, not only
the first: a session may be (re)made at any call (a resync, an expired id), and an item whose
partition differs from the one the id's session was made for asks for a resync instead of
drafting from another partition's outputs.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specd_core.draft import DraftBlock, Drafter, drafter_capabilities, propose_ahead
from specd_core.sampling import DraftSamplingParams

from .eagle import NeedsResync

log = logging.getLogger(__name__)


class ProposeRefused(ValueError):
    """A Propose call the worker refuses as a whole (``INVALID_ARGUMENT``); the message names
    the field. Nothing in the call was applied."""


@dataclass(frozen=True)
class SessionLimits:
    """Bounds on what a drafter worker holds for its callers.

    Attributes:
        max_history: the most tokens one request's history may reach (the service passes the
            model's context length; the default is SmolLM2's); a Propose item beyond it
            refuses the whole call.
        max_sessions: the most request ids held; past it the least recently used id is
            forgotten (its next call resyncs, which costs a resend, never an output).
        idle_timeout_s: seconds after its last Propose an id is forgotten (checked on every
            call; memory is bounded by the other two limits meanwhile).

    Raises:
        ValueError: a limit that is not positive.
    """

    max_history: int = 8192
    max_sessions: int = 1024
    idle_timeout_s: float = 600.0

    def __post_init__(self):
        for name in ("max_history", "max_sessions"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not self.idle_timeout_s > 0:
            raise ValueError(f"idle_timeout_s must be > 0, got {self.idle_timeout_s!r}")


#: The counters `DrafterSessions.stats` reports (the drafter proto's ``StatsResponse``
#: fields but ``has_cache``).
DRAFTER_STATS = ("cache_outputs", "cache_tokens", "cache_nodes", "cache_bytes",
                 "cache_evicted", "proposals", "global_hits", "cache_partitions")

#: The longest partition name accepted (characters): the coordinator sends a short digest;
#: a longer one is refused (a Propose item) or its output dropped (remember), so names
#: cannot grow a worker's memory past its output bound times this.
MAX_PARTITION_CHARS = 256


def _no_hidden() -> None:
    return None


class DrafterSessions:
    """Per-request history views and drafter sessions over one `Drafter`. Not thread-safe:
    one caller at a time.

    Args:
        drafter: the `Drafter` served.
        limits: what is held at most (`SessionLimits`; default: its defaults).
        clock: seconds, monotonic (injectable for tests of idle expiry).
    """

    def __init__(self, drafter: Drafter, limits: SessionLimits | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.drafter = drafter
        self.capabilities = drafter_capabilities(drafter)
        self.limits = limits or SessionLimits()
        self._clock = clock
        # request id -> the committed history the drafter has seen (prompt first).
        self._histories: dict[str, list[int]] = {}
        # request id -> time of its last Propose, least recently used first.
        self._last_used: OrderedDict[str, float] = OrderedDict()
        # request id -> its own session of the drafter (`DrafterCapabilities.sessions`).
        self._sessions: dict[str, Drafter] = {}
        # request id -> the partition its history and session belong to.
        self._partitions: dict[str, str] = {}

    def check_length(self, index: int, known: int, appended: int) -> None:
        """Raises `ProposeRefused` when item ``index`` (``known`` held + ``appended`` new
        tokens) would exceed ``limits.max_history``."""
        total = known + appended
        if total > self.limits.max_history:
            raise ProposeRefused(
                f"items[{index}].append: a history of {total} tokens (known {known} + "
                f"{appended} appended) exceeds max_history {self.limits.max_history}")

    @staticmethod
    def check_partition(index: int, partition: str) -> None:
        """Raises `ProposeRefused` when item ``index``'s ``partition`` is longer than
        `MAX_PARTITION_CHARS`."""
        if len(partition) > MAX_PARTITION_CHARS:
            raise ProposeRefused(
                f"items[{index}].partition: {len(partition)} characters exceeds "
                f"{MAX_PARTITION_CHARS}")

    def known(self, request_id: str) -> int:
        """History tokens held for the id (0 when none)."""
        stored = self._histories.get(request_id)
        return 0 if stored is None else len(stored)

    def propose(self, request_id: str, known: int, append: Sequence[int], max_len: int,
                load_hidden: Callable[[], torch.Tensor | None] = _no_hidden,
                sampling: DraftSamplingParams | None = None, seed: int = 0,
                assumed: Sequence[int] = (), ahead: bool = False,
                partition: str = "") -> tuple[bool, DraftBlock]:
        """One proposal for ``request_id``, whose caller believes ``known`` tokens are held and
        sends ``append`` after them. Returns ``(resync, block)``: ``resync`` asks the caller
        to resend the whole history (the id's view was dropped); ``block`` is at most
        ``max_len`` long. A drafting problem gives an empty block, logged, never raised.

        ``load_hidden`` returns the hidden rows sent with the item (called once, after the
        history check; a ValueError from it drops the id's view). ``sampling`` and ``seed``
        configure a new per-request session. ``ahead``: a run-ahead proposal past
        ``assumed`` (`specd_core.draft.propose_ahead`); ``assumed`` is never stored, so the
        id's view stays the committed history. ``partition``: the request's partition of
        the cross-request state (see the module); an id held for another partition asks for
        a resync.
        """
        rid = request_id
        partition = str(partition)
        stored = self._histories.get(rid)
        if known == 0:
            base: list[int] = []  # a fresh history: replaces any state of a reused id
            self._sessions.pop(rid, None)
        elif stored is None or len(stored) != known or \
                self._partitions.get(rid, "") != partition:
            self._forget(rid)
            return True, DraftBlock.empty()
        else:
            base = stored
        try:
            hidden = load_hidden()
        except ValueError:
            # The drafter never sees this step, so the id's view is dropped; the caller's
            # next `known` then mismatches and it resyncs.
            log.exception("request %r: bad hidden tensor", rid)
            self._forget(rid)
            return False, DraftBlock.empty()
        history = base + [int(t) for t in append]  # a new list: `stored` may be shared
        if not history:
            self._forget(rid)
            log.warning("request %r: empty history, nothing to draft from", rid)
            return False, DraftBlock.empty()
        # Committed before drafting: a drafter failure does not change what was committed.
        self._histories[rid] = history
        self._partitions[rid] = partition
        self._touch(rid)
        max_len = int(max_len)
        drafter = self._drafter_for(rid, sampling, seed, partition)
        try:
            if ahead:
                block = propose_ahead(drafter, history, hidden, [int(t) for t in assumed],
                                      max_len)
            else:
                block = drafter.propose(history, hidden, max_len)
        except NeedsResync as e:
            # The drafter's state and the rows sent do not line up (e.g. rows lost with a
            # failed call): start over with the whole history and every row.
            log.warning("request %r: %s; asking for a resync", rid, e)
            self._forget(rid)
            return True, DraftBlock.empty()
        except Exception:
            log.exception("drafter %s failed for request %r", type(self.drafter).__name__, rid)
            return False, DraftBlock.empty()
        if not isinstance(block, DraftBlock):
            log.error("drafter returned %s, not a DraftBlock", type(block).__name__)
            return False, DraftBlock.empty()
        if len(block) > max_len:
            # A new block: truncating in place would alter an object the drafter may keep.
            block = DraftBlock(block.tokens[:max_len], block.dists[:max_len])
        return False, block

    def _drafter_for(self, rid: str, sampling: DraftSamplingParams | None, seed: int,
                     partition: str = "") -> Drafter:
        """The shared drafter, or the id's own session of it (created on first use with the
        request's sampling transforms and seed, and its partition for a drafter with a
        cross-request cache)."""
        caps = self.capabilities
        if not caps.sessions:
            return self.drafter
        session = self._sessions.get(rid)
        if session is None:
            session = self._sessions[rid] = (
                self.drafter.session(sampling, seed, partition) if caps.remembers
                else self.drafter.session(sampling, seed))
        return session

    def _forget(self, rid: str) -> None:
        self._histories.pop(rid, None)
        self._sessions.pop(rid, None)
        self._partitions.pop(rid, None)
        self._last_used.pop(rid, None)

    def _touch(self, rid: str) -> None:
        """Marks ``rid`` used now; forgets the least recently used ids past the session cap."""
        self._last_used[rid] = self._clock()
        self._last_used.move_to_end(rid)
        while len(self._last_used) > self.limits.max_sessions:
            oldest = next(iter(self._last_used))
            log.warning("holding %d request ids (max_sessions): forgetting %r, the least "
                        "recently used", len(self._last_used), oldest)
            self._forget(oldest)

    def expire_idle(self) -> list[str]:
        """Forgets every id whose last Propose is more than ``limits.idle_timeout_s`` ago;
        returns them (oldest first)."""
        deadline = self._clock() - self.limits.idle_timeout_s
        expired = []
        while self._last_used:
            rid, used = next(iter(self._last_used.items()))
            if used >= deadline:
                break
            expired.append(rid)
            self._forget(rid)
        if expired:
            log.info("forgot %d request ids idle for over %.0f s", len(expired),
                     self.limits.idle_timeout_s)
        return expired

    def release(self, request_ids: Sequence[str]) -> None:
        """Forgets the given ids; unknown ids are ignored."""
        self.expire_idle()
        for rid in request_ids:
            self._forget(rid)

    def remember(self, outputs: Sequence[Sequence[int]],
                 partitions: Sequence[str] | None = None) -> int:
        """Hands finished requests' outputs to a drafter with a cross-request cache
        (`DrafterCapabilities.remembers`), output ``i`` for partition ``partitions[i]``
        (None: all shared, ""); returns how many it took (0 for a drafter without one, which
        ignores them). An output whose partition is longer than `MAX_PARTITION_CHARS` is
        dropped (logged). A drafter failure is logged, never raised.

        Raises:
            ValueError: ``partitions`` not one per output.
        """
        if partitions is None:
            partitions = [""] * len(outputs)
        elif len(partitions) != len(outputs):
            raise ValueError(f"remember: {len(partitions)} partitions for {len(outputs)} "
                             "outputs (one each)")
        if not outputs or not self.capabilities.remembers:
            return 0
        kept, names = [], []
        for out, partition in zip(outputs, partitions, strict=True):
            partition = str(partition)
            if len(partition) > MAX_PARTITION_CHARS:
                log.warning("an output's partition has %d characters (> %d): not kept",
                            len(partition), MAX_PARTITION_CHARS)
                continue
            kept.append([int(t) for t in out])
            names.append(partition)
        if not kept:
            return 0
        try:
            self.drafter.remember(kept, names)
        except Exception:
            log.exception("drafter %s failed to remember %d outputs",
                          type(self.drafter).__name__, len(kept))
            return 0
        return len(kept)

    def stats(self) -> dict:
        """The drafter's counters as the ``StatsResponse`` fields (`DRAFTER_STATS`):
        ``has_cache`` (a cross-request cache, `DrafterCapabilities.remembers`), the cache's
        ``cache_outputs``, ``cache_tokens``, ``cache_nodes``, ``cache_bytes`` (approximate)
        and ``cache_evicted`` (totals over its partitions), ``cache_partitions`` (how many
        partitions hold an output), and ``proposals`` / ``global_hits`` (proposals made, of which
        drafted from previous outputs), read from ``drafter.stats()`` in
        `drafter_worker.suffix.SuffixDrafter.stats`'s shape. A drafter without ``stats()``
        (or whose call fails, logged) reports zeros."""
        out = dict.fromkeys(DRAFTER_STATS, 0)
        out["has_cache"] = bool(self.capabilities.remembers)
        read = getattr(self.drafter, "stats", None)
        if not callable(read):
            return out
        try:
            s = read()
            cache = s.get("cache", {})
            out.update(cache_outputs=int(cache.get("outputs", 0)),
                       cache_tokens=int(cache.get("tokens", 0)),
                       cache_nodes=int(cache.get("nodes", 0)),
                       cache_bytes=int(cache.get("approx_bytes", 0)),
                       cache_evicted=int(cache.get("evicted", 0)),
                       cache_partitions=int(cache.get("partitions", 0)),
                       proposals=int(s.get("proposals", 0)),
                       global_hits=int(s.get("global_wins", 0)))
        except Exception:
            log.exception("drafter %s: stats() failed", type(self.drafter).__name__)
        return out

    def history(self, request_id: str) -> list[int] | None:
        """A copy of the drafter's view of ``request_id``, or None if it holds none."""
        stored = self._histories.get(request_id)
        return None if stored is None else list(stored)

    def __len__(self) -> int:
        """Number of request ids with state."""
        return len(self._histories)
