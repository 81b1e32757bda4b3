"""One target replica as the router holds it: its target behind a meter and a deadline
(`MeteredTarget`), its own scheduler loop (`ReplicaScheduler`) and its record (`Replica`)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from specd_core.request import SpeculativeOptions
from specd_core.step import payload_bytes

from ..step.errors import REPLICA_FAILED, ReplicaFailed, ReplicaUnavailable
from ..step.plan import ChunkPolicy
from ..step.requests import ServiceRequest
from ..step.scheduler import Scheduler
from ..step.targets import Target
from .failures import STALL_FACTOR, STALL_FLOOR_S, StallWatchdog, death_summary, is_replica_death

log = logging.getLogger(__name__)


class RateMeter:
    """Events per second over a sliding window (``count in the last window_s`` / window_s)."""

    def __init__(self, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self.clock = clock
        self._events: deque[tuple[float, int]] = deque()

    def add(self, n: int) -> None:
        now = self.clock()
        self._events.append((now, n))
        self._trim(now)

    def rate(self) -> float:
        self._trim(self.clock())
        return sum(n for _, n in self._events) / self.window_s

    def _trim(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self.window_s:
            self._events.popleft()


class MeteredTarget:
    """A `Target` that counts, per kind (``prefill``, ``verify``): calls, wall seconds as the
    coordinator sees them (transport included), and payload bytes sent and received
    (`specd_core.step.payload_bytes`: counted from the items' and outputs' structure, the
    step is not serialised again to measure it); and
    that supervises every call.

    Supervision: a call that raises a replica death error (`is_replica_death`) or runs past
    its deadline marks the replica failed (`failure` says why, for the log) and raises
    `ReplicaFailed`; once failed, every call raises `ReplicaFailed` at once (a dead replica is
    never waited on again). The deadline is `StallWatchdog`'s: ``stall_factor`` times the
    call's predicted cost from this replica's measured calls, at least ``stall_floor_s``, at
    most ``timeout_s``.

    Args:
        inner: the replica's `Target`.
        timeout_s: the most one call may take in seconds (allocate, free, prefill, verify),
            or None: no deadline at all.
        stall_factor, stall_floor_s: see `StallWatchdog`.
    """

    def __init__(self, inner: Target, timeout_s: float | None = None,
                 stall_factor: float = STALL_FACTOR, stall_floor_s: float = STALL_FLOOR_S):
        self.inner = inner
        self.timeout_s = timeout_s
        self.watchdog = None if timeout_s is None else StallWatchdog(
            timeout_s, stall_factor, min(stall_floor_s, timeout_s))
        self.failure: str | None = None
        #: Called once (on the event loop) when the replica is first marked failed, by
        #: whatever found it: a call (``free`` included), a probe, a closed channel.
        self.on_failed: Callable[[], None] | None = None
        self.stats: dict[str, float] = {}
        for kind in ("prefill", "verify"):
            for key in ("calls", "seconds", "bytes_sent", "bytes_received"):
                self.stats[f"{kind}_{key}"] = 0

    @property
    def failed(self) -> bool:
        return self.failure is not None

    def mark_failed(self, why: str) -> None:
        if self.failure is None:
            self.failure = why
            if self.on_failed is not None:
                self.on_failed()

    async def allocate(self) -> int:
        return await self._guarded("allocate", self.inner.allocate)

    async def allocate_prefix(self, tokens: list[int], partition: str = "") -> tuple[int, int]:
        return await self._guarded("allocate",
                                   lambda: self.inner.allocate_prefix(tokens, partition))

    async def free(self, slot: int) -> None:
        await self._guarded("free", lambda: self.inner.free(slot))

    async def prefill(self, items: list) -> list:
        return await self._metered("prefill", lambda: self.inner.prefill(items), items)

    async def verify(self, items: list) -> list:
        return await self._metered("verify", lambda: self.inner.verify(items), items)

    async def _guarded(self, kind: str, call: Callable[[], Awaitable], tokens: int = 0):
        if self.failure is not None:
            raise ReplicaFailed(self.failure)
        limit = None if self.watchdog is None else self.watchdog.deadline_s(tokens)
        try:
            if limit is None:
                return await call()
            async with asyncio.timeout(limit) as deadline:
                return await call()
        except TimeoutError as exc:
            if limit is None or not deadline.expired():
                raise
            predicted = self.watchdog.predicted_s(tokens)
            self.mark_failed(f"{kind} of {tokens} tokens did not answer within {limit:.3g} s"
                             + ("" if predicted is None else
                                f" (its measured cost predicts {predicted:.3g} s)"))
            raise ReplicaFailed(self.failure) from exc
        except Exception as exc:
            if not is_replica_death(exc):
                raise
            log.debug("a %s call found its replica dead: %s", kind, exc)  # Ray's raw report
            self.mark_failed(f"a {kind} call failed: {death_summary(exc)}")
            raise ReplicaFailed(self.failure) from exc

    async def _metered(self, kind: str, call, items: list) -> list:
        sent = payload_bytes(items)
        tokens = sum(len(item.tokens) for item in items)
        start = time.perf_counter()
        out = await self._guarded(kind, call, tokens)
        seconds = time.perf_counter() - start
        if self.watchdog is not None:
            self.watchdog.observe(tokens, seconds)
        self.stats[f"{kind}_seconds"] += seconds
        self.stats[f"{kind}_calls"] += 1
        self.stats[f"{kind}_bytes_sent"] += sent
        self.stats[f"{kind}_bytes_received"] += payload_bytes(out)
        return out

    async def replica_status(self) -> dict:
        """The replica's own ``status()`` (`TargetActor.status`) when it has one, else {}
        (also once it failed)."""
        if self.failure is not None:
            return {}
        handle = getattr(self.inner, "handle", None)
        if handle is not None:
            return await handle.status.remote()
        engine = getattr(self.inner, "engine", None)
        if engine is not None:
            return {"used_slots": engine.used_slots, "max_slots": engine.max_slots,
                    "stats": dict(engine.stats)}
        return {}


class ReplicaScheduler(Scheduler):
    """The `Scheduler` of one replica plus what routing, draining and supervision need: the
    set of requests it holds, a token rate meter, `drain`, `adopt`. Request ids come from a
    counter shared by all replicas, so they are unique service-wide (the drafter pool keys
    by id).

    Args:
        on_failure: called once, as ``on_failure(scheduler, unstarted)``, when the target
            turns out dead or unresponsive (`MeteredTarget.failed`); ``unstarted`` are the
            requests it held but had not prefilled, for the router to place elsewhere (the
            rest fail with `ReplicaUnavailable`: `_on_target_failure`); it may return
            what happens to the replica next ("re-creating it"), for the failure's log line.
    """

    def __init__(self, name: str, target: MeteredTarget, drafter, ids: itertools.count,
                 max_active: int = 32, wants_hidden: bool = False, adaptive: bool = False,
                 cost_model=None, pipeline: bool | str = False,
                 on_failure: Callable[[ReplicaScheduler, list[ServiceRequest]], str | None]
                 | None = None, chunking: ChunkPolicy | None = None,
                 prefix_caching: bool = True, hidden_layers: Sequence[int] = ()):
        super().__init__(target, drafter, max_active=max_active, wants_hidden=wants_hidden,
                         adaptive=adaptive, cost_model=cost_model, pipeline=pipeline,
                         chunking=chunking, prefix_caching=prefix_caching,
                         hidden_layers=hidden_layers)
        self.name = name
        self._ids = ids
        self.on_failure = on_failure
        self.requests: set[ServiceRequest] = set()
        self.placed = 0
        self.tokens_emitted = 0
        self.meter = RateMeter()
        self._empty = asyncio.Event()
        self._empty.set()
        self._failure_handled = False

    def submit(self, prompt_tokens: Sequence[int], options: SpeculativeOptions,
               speculate: bool = True, max_draft_len: int | None = None,
               partition: str = "") -> ServiceRequest:
        req = super().submit(prompt_tokens, options, speculate, max_draft_len,
                             partition=partition)
        self.requests.add(req)
        self.placed += 1
        self._empty.clear()
        return req

    def adopt(self, req: ServiceRequest) -> None:
        """Queues a request another replica held but never prefilled (its events queue and id
        stay, it holds no slot; nothing about it was computed yet, so its output is unchanged)."""
        req.adaptive = None  # priced with the other replica's cost model
        self.waiting.append(req)
        self.requests.add(req)
        self.placed += 1
        self._empty.clear()
        self._wakeup.set()

    def load(self) -> tuple[int, int]:
        """(requests held — decoding or waiting, tokens still to process — prompts awaiting
        prefill plus tokens still to generate); smaller is less loaded."""
        tokens = 0
        for r in self.requests:
            if r.slot is None:
                tokens += r.decode.num_prompt_tokens
            tokens += r.decode.options.max_new_tokens - len(r.decode.generated)
        return len(self.requests), tokens

    async def drain(self) -> None:
        """Waits until every request it holds has finished (or was cancelled), then stops
        its loop. The caller must stop submitting first."""
        await self._empty.wait()
        self._closed = True  # the loop ends at its next boundary, never inside a step
        self._wakeup.set()
        if self._task is not None:
            await self._task

    def _emitted(self, n: int) -> None:
        if n:
            self.tokens_emitted += n
            self.meter.add(n)

    async def _release(self, req: ServiceRequest, count: bool = True) -> None:
        if self.target.failed:
            self._take_slot(req)  # its slot died with the replica: nothing to free
        try:
            await super()._release(req, count)
        finally:
            self.requests.discard(req)
            if not self.requests:
                self._empty.set()

    async def _on_target_failure(self, exc: Exception, requests: list[ServiceRequest]) -> None:
        """The replica is dead or unresponsive (else: `Scheduler._on_target_failure`). This
        loop ends; the requests it held that were in the failed call or had been prefilled
        fail with `ReplicaUnavailable` (their cache is gone mid-stream); the others (waiting,
        or admitted but not yet prefilled) go to ``on_failure`` to be placed elsewhere."""
        if not self.target.failed:
            await super()._on_target_failure(exc, requests)
            return
        if self._failure_handled:
            return
        self._failure_handled = True
        self._closed = True
        self._wakeup.set()
        in_call = {*requests, *self.active}
        lost = [r for r in self.requests if r in in_call or r.decode.result.forward_calls > 0]
        unstarted = [r for r in self.requests if r not in in_call and
                     r.decode.result.forward_calls == 0]
        self.requests.difference_update(unstarted)
        self.waiting.clear()
        for req in unstarted:  # a slot allocated on the dead replica dies with it
            self._take_slot(req)
        self._admitting = []
        after = None
        if self.on_failure is not None:
            after = self.on_failure(self, sorted(unstarted, key=lambda r: r.submitted_at))
        # One line (Ray's raw report went to DEBUG where it was caught): which replica, what
        # happened, what the requests and the replica itself get now.
        log.error("replica %s is out of service: %s; %d request(s) in flight failed, %d "
                  "not yet started re-placed; %s", self.name, self.target.failure, len(lost),
                  len(unstarted), after or "it is not restarted")
        for req in lost:
            await self._fail(req, exc, ReplicaUnavailable(REPLICA_FAILED))
        self.active = []
        if not self.requests:
            self._empty.set()


@dataclass(eq=False)
class Replica:
    name: str
    scheduler: ReplicaScheduler
    target: MeteredTarget
    stop: Callable[[], Awaitable[None]] | None
    info: dict = field(default_factory=dict)
    #: "serving", "draining", "restarting" (failed; being re-created) or "failed" (its
    #: re-creation failed; retried with backoff).
    state: str = "serving"
    reported: dict = field(default_factory=dict)  # the replica's last status()
    restarts: int = 0
    #: `time.monotonic` of the first of the unanswered status probes in a row while it held
    #: no request (None: it answered the last one, or was busy).
    silent_since: float | None = None


__all__ = ["MeteredTarget", "RateMeter", "Replica", "ReplicaScheduler"]
