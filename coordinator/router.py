"""Target replicas (data parallel) behind one front end, and scaling while serving.

A `Router` runs one `ReplicaScheduler` per target replica (each its own continuous-batching
loop and KV slots, the unchanged `Scheduler`), places each new request on the least-loaded
serving replica, and shares one `DrafterPool` among them. It has the `Scheduler`'s
``submit`` / ``cancel`` / ``status`` so the Generation server drives either.

`Router.scale` adds and removes replicas and drafters while requests run. A replica leaves by
draining: it stops getting requests, the ones it holds finish, then its loop stops and its
actors are destroyed. A drafter leaves at once; its requests continue on another one.

Metrics (`Router.status`): per replica, requests, tokens/s (last 10 s), mean wall time of a
verify call as the coordinator sees it, the replica's own forward time per call, and the
pickled bytes of verify inputs and outputs per step; per drafter, calls, errors, latency.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import pickle
import time
import weakref
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from .drafter_pool import DrafterPool
from .scheduler import Scheduler, ServiceRequest, Target
from .speculative import SpeculativeOptions

log = logging.getLogger(__name__)

#: Upper bound on either count in one `Router.scale` call (a typo guard, not a design limit).
MAX_COUNT = 64

#: ``async (name) -> (target, stop, info)``: starts a replica; ``info`` is its ``model_info``
#: dict (plus anything to report, e.g. ``tp``); ``stop`` destroys it.
ReplicaFactory = Callable[[str], Awaitable[tuple[Target, Callable[[], Awaitable[None]], dict]]]
#: ``async (name) -> (client, stop)``: starts a drafter worker and a client for it.
DrafterFactory = Callable[[str], Awaitable[tuple[object, Callable[[], Awaitable[None]]]]]


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


def pickled_size(obj) -> int:
    """Bytes of ``obj`` pickled (protocol 5, what Ray's serializer is built on): the size of
    a step's inputs or outputs on the wire to a replica, measured on the coordinator side."""
    return len(pickle.dumps(obj, protocol=5))


class MeteredTarget:
    """A `Target` that counts, per kind (``prefill``, ``verify``): calls, wall seconds as the
    coordinator sees them (transport included), and pickled bytes sent and received."""

    def __init__(self, inner: Target):
        self.inner = inner
        self.stats: dict[str, float] = {}
        for kind in ("prefill", "verify"):
            for key in ("calls", "seconds", "bytes_sent", "bytes_received"):
                self.stats[f"{kind}_{key}"] = 0

    async def allocate(self) -> int:
        return await self.inner.allocate()

    async def free(self, slot: int) -> None:
        await self.inner.free(slot)

    async def prefill(self, items: list) -> list:
        return await self._metered("prefill", self.inner.prefill, items)

    async def verify(self, items: list) -> list:
        return await self._metered("verify", self.inner.verify, items)

    async def _metered(self, kind: str, call, items: list) -> list:
        sent = pickled_size(items)
        start = time.perf_counter()
        out = await call(items)
        self.stats[f"{kind}_seconds"] += time.perf_counter() - start
        self.stats[f"{kind}_calls"] += 1
        self.stats[f"{kind}_bytes_sent"] += sent
        self.stats[f"{kind}_bytes_received"] += pickled_size(out)
        return out

    async def replica_status(self) -> dict:
        """The replica's own ``status()`` (`TargetActor.status`) when it has one, else {}."""
        handle = getattr(self.inner, "handle", None)
        if handle is not None:
            return await handle.status.remote()
        engine = getattr(self.inner, "engine", None)
        if engine is not None:
            return {"used_slots": engine.used_slots, "max_slots": engine.max_slots,
                    "stats": dict(engine.stats)}
        return {}


class ReplicaScheduler(Scheduler):
    """The `Scheduler` of one replica plus what routing and draining need: the set of
    requests it holds, a token rate meter, and `drain`. Request ids come from a counter
    shared by all replicas, so they are unique service-wide (the drafter pool keys by id)."""

    def __init__(self, name: str, target: MeteredTarget, drafter, ids: itertools.count,
                 max_active: int = 32, wants_hidden: bool = False, adaptive: bool = False,
                 cost_model=None):
        super().__init__(target, drafter, max_active=max_active, wants_hidden=wants_hidden,
                         adaptive=adaptive, cost_model=cost_model)
        self.name = name
        self._ids = ids
        self.requests: set[ServiceRequest] = set()
        self.placed = 0
        self.tokens_emitted = 0
        self.meter = RateMeter()
        self._empty = asyncio.Event()
        self._empty.set()

    def submit(self, prompt_tokens: Sequence[int], options: SpeculativeOptions,
               speculate: bool = True, max_draft_len: int | None = None) -> ServiceRequest:
        req = super().submit(prompt_tokens, options, speculate, max_draft_len)
        self.requests.add(req)
        self.placed += 1
        self._empty.clear()
        return req

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

    async def _after_step(self, req: ServiceRequest) -> None:
        before = req.emitted
        await super()._after_step(req)
        if req.emitted > before:
            self.tokens_emitted += req.emitted - before
            self.meter.add(req.emitted - before)

    async def _release(self, req: ServiceRequest, count: bool = True) -> None:
        try:
            await super()._release(req, count)
        finally:
            self.requests.discard(req)
            if not self.requests:
                self._empty.set()


@dataclass(eq=False)
class Replica:
    name: str
    scheduler: ReplicaScheduler
    target: MeteredTarget
    stop: Callable[[], Awaitable[None]] | None
    info: dict = field(default_factory=dict)
    state: str = "serving"  # or "draining"
    reported: dict = field(default_factory=dict)  # the replica's last status()


_GAUGES = ("active_requests", "waiting_requests", "used_slots", "total_slots")
_COUNTERS = ("steps", "tokens_generated", "forward_calls", "drafter_failures", "completed",
             "cancelled")


def check_count(name: str, value, minimum: int) -> None:
    """Raises ValueError naming ``name`` unless ``value`` is None or an int in
    [minimum, `MAX_COUNT`]."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= MAX_COUNT:
        raise ValueError(f"{name}: must be an integer in [{minimum}, {MAX_COUNT}], got {value!r}")


class Router:
    """Target replicas and a drafter pool behind the `Scheduler` interface.

    Args:
        replica_factory: starts a replica (see `ReplicaFactory`).
        drafter_factory: starts a drafter worker (see `DrafterFactory`), or None for a
            service without drafters.
        max_active: requests decoding at once per replica.
        drafter_pool: the pool to use (default: a new one).
        adaptive: choose each request's draft length per step (`Scheduler` ``adaptive``);
            each replica calibrates its own forward cost unless ``cost_model`` is given.
        cost_model: a `coordinator.adaptive.ForwardCostModel` shared by every replica
            (tests); None calibrates per replica.
    """

    def __init__(self, replica_factory: ReplicaFactory,
                 drafter_factory: DrafterFactory | None = None, max_active: int = 32,
                 drafter_pool: DrafterPool | None = None, adaptive: bool = True,
                 cost_model=None):
        self.replica_factory = replica_factory
        self.adaptive = adaptive
        self.cost_model = cost_model
        self.drafter_factory = drafter_factory
        self.max_active = max_active
        self.pool = drafter_pool or DrafterPool()
        self.pool.on_failure = self._on_drafter_failure
        self.replicas: dict[str, Replica] = {}
        self.wants_hidden = False
        self._ids = itertools.count()
        self._replica_names = itertools.count()
        self._drafter_names = itertools.count()
        self._owner: weakref.WeakValueDictionary[str, ServiceRequest] = \
            weakref.WeakValueDictionary()
        self._placement: weakref.WeakKeyDictionary[ServiceRequest, Replica] = \
            weakref.WeakKeyDictionary()
        self._lock = asyncio.Lock()
        self._hidden_known = False
        self._retired = dict.fromkeys(_COUNTERS, 0)  # counters of removed replicas

    # ---- the Scheduler interface ----

    def start(self) -> None:
        """Nothing to start: each replica's loop starts when the replica is added."""

    def serving(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.state == "serving"]

    def submit(self, prompt_tokens: Sequence[int], options: SpeculativeOptions,
               speculate: bool = True, max_draft_len: int | None = None) -> ServiceRequest:
        """Queues a request on the least-loaded serving replica (`ReplicaScheduler.load`;
        ties go to the replica that was given fewer requests so far, so a lightly loaded
        service still spreads them).

        Raises:
            ValueError: an empty prompt or invalid options.
            RuntimeError: no replica is serving.
        """
        serving = self.serving()
        if not serving:
            raise RuntimeError("no target replica is serving")
        replica = min(serving, key=lambda r: (*r.scheduler.load(), r.scheduler.placed))
        req = replica.scheduler.submit(prompt_tokens, options, speculate, max_draft_len)
        self._placement[req] = replica
        self._owner[req.id] = req
        return req

    def placement(self, req: ServiceRequest) -> str | None:
        """The name of the replica ``req`` was placed on."""
        replica = self._placement.get(req)
        return None if replica is None else replica.name

    def cancel(self, req: ServiceRequest) -> None:
        replica = self._placement.get(req)
        if replica is not None:
            replica.scheduler.cancel(req)

    def status(self) -> dict:
        """The `Scheduler.status` fields summed over replicas, plus ``replicas`` (one dict
        per replica, see `replica_status`) and ``drafters`` (`DrafterPool.status`)."""
        replicas = [self.replica_status(r) for r in self.replicas.values()]
        total = {key: sum(r[key] for r in replicas) for key in (*_GAUGES, *_COUNTERS)}
        for key, value in self._retired.items():  # counters never go back on a scale-down
            total[key] += value
        return {**total, "replicas": replicas, "drafters": self.pool.status()}

    def replica_status(self, replica: Replica) -> dict:
        """One replica's metrics. Means are per verify call (one per step): ``step_seconds``
        (coordinator-side wall time, transport included), ``bytes_sent_per_step`` /
        ``bytes_received_per_step`` (pickled); ``forward_seconds_per_call`` is the replica's
        own forward time per forward call from its last ``status()`` (0 when unknown)."""
        s = replica.scheduler.status()
        m = replica.target.stats
        steps = m["verify_calls"]
        reported = replica.reported.get("stats", {})
        fwd_calls = reported.get("forward_calls", 0)
        return {
            "name": replica.name,
            "state": replica.state,
            "tp": int(replica.info.get("tp", 1)),
            **s,
            "requests_placed": replica.scheduler.placed,
            "tokens_emitted": replica.scheduler.tokens_emitted,
            "tokens_per_second": replica.scheduler.meter.rate(),
            "step_seconds": m["verify_seconds"] / steps if steps else 0.0,
            "bytes_sent_per_step": m["verify_bytes_sent"] / steps if steps else 0.0,
            "bytes_received_per_step": m["verify_bytes_received"] / steps if steps else 0.0,
            "forward_seconds_per_call": (reported.get("forward_seconds", 0.0) / fwd_calls
                                         if fwd_calls else 0.0),
            **{f"target_{k}": v for k, v in m.items()},
        }

    async def refresh(self, timeout_s: float = 2.0) -> None:
        """Fetches each replica's own ``status()`` (forward time) for `status`; a replica
        that does not answer in time keeps its previous report."""
        async def one(replica: Replica) -> None:
            try:
                replica.reported = await asyncio.wait_for(
                    replica.target.replica_status(), timeout_s)
            except Exception as exc:  # metrics only: never fail Status over them
                log.warning("replica %s status failed: %r", replica.name, exc)

        await asyncio.gather(*(one(r) for r in list(self.replicas.values())))

    # ---- scaling ----

    async def scale(self, target_replicas: int | None = None, drafters: int | None = None
                    ) -> dict:
        """Brings the counts of serving replicas and drafters to the given values (None keeps
        one as is) and returns ``{"target_replicas", "drafters", "added", "removed"}``.

        Drafters are added first (new replicas may then ask them whether they want hidden
        rows). Replicas to remove are the least loaded ones; each drains before it is
        destroyed, so this returns only when their requests have finished. Scale calls run
        one at a time.

        Raises:
            ValueError: a count below 1 (replicas) or 0 (drafters), above `MAX_COUNT`, not an
                integer, or drafters > 0 on a service without a drafter. Nothing changes.
            RuntimeError: starting a replica or drafter failed (the others that started are
                kept; the message names the failure).
        """
        check_count("target_replicas", target_replicas, 1)
        check_count("drafters", drafters, 0)
        if drafters and self.drafter_factory is None:
            raise ValueError("drafters: this service runs without a drafter (--drafter none)")
        async with self._lock:
            added: list[str] = []
            removed: list[str] = []
            errors: list[str] = []
            if drafters is not None:
                await self._scale_drafters(drafters, added, removed, errors)
            if target_replicas is not None:
                await self._scale_replicas(target_replicas, added, removed, errors)
            if errors:
                raise RuntimeError("; ".join(errors))
            return {"target_replicas": len(self.serving()), "drafters": len(self.pool.serving()),
                    "added": added, "removed": removed}

    async def _scale_drafters(self, want: int, added: list, removed: list, errors: list) -> None:
        have = self.pool.serving()
        if want > len(have):
            started = await _start_all("drafter", self._drafter_names, want - len(have),
                                       self.drafter_factory, errors)
            for name, (client, stop) in started:
                self.pool.add(name, client, stop)
                added.append(name)
            if not self._hidden_known and self.pool.serving():
                self.wants_hidden = (await self.pool.info()).wants_hidden
                self._hidden_known = True
                for replica in self.replicas.values():
                    replica.scheduler.wants_hidden = self.wants_hidden
        elif want < len(have):
            leaving = sorted(have, key=lambda m: (len(m.assigned), m.in_flight))[:len(have) - want]
            await asyncio.gather(*(self.pool.remove(m.name) for m in leaving))
            removed.extend(m.name for m in leaving)

    async def _scale_replicas(self, want: int, added: list, removed: list, errors: list) -> None:
        have = self.serving()
        if want > len(have):
            started = await _start_all("replica", self._replica_names, want - len(have),
                                       self.replica_factory, errors)
            for name, (target, stop, info) in started:
                self._add_replica(name, target, stop, info)
                added.append(name)
        elif want < len(have):
            leaving = sorted(have, key=lambda r: r.scheduler.load())[:len(have) - want]
            for replica in leaving:
                replica.state = "draining"
            await asyncio.gather(*(self._remove_replica(r) for r in leaving))
            removed.extend(r.name for r in leaving)

    def _add_replica(self, name: str, target: Target, stop, info: dict) -> Replica:
        metered = MeteredTarget(target)
        scheduler = ReplicaScheduler(name, metered, self.pool, self._ids,
                                     max_active=self.max_active, wants_hidden=self.wants_hidden,
                                     adaptive=self.adaptive, cost_model=self.cost_model)
        replica = self.replicas[name] = Replica(name, scheduler, metered, stop, dict(info))
        scheduler.start()
        return replica

    async def _remove_replica(self, replica: Replica) -> None:
        await replica.scheduler.drain()
        final = replica.scheduler.status()
        for key in _COUNTERS:
            self._retired[key] += final[key]
        del self.replicas[replica.name]
        if replica.stop is not None:
            await replica.stop()

    def model_info(self) -> dict:
        """The first replica's ``model_info``.

        Raises:
            RuntimeError: no replica.
        """
        if not self.replicas:
            raise RuntimeError("no target replica")
        return next(iter(self.replicas.values())).info

    async def close(self) -> None:
        """Stops every replica loop (failing what is in flight) and destroys replicas and
        drafters."""
        for replica in list(self.replicas.values()):
            await replica.scheduler.close()
            self.replicas.pop(replica.name, None)
            if replica.stop is not None:
                try:
                    await replica.stop()
                except Exception:
                    log.exception("stopping replica %s failed", replica.name)
        await self.pool.close()

    # ---- internals ----

    def _on_drafter_failure(self, request_ids: list[str]) -> None:
        # Counted as the single-drafter scheduler counts: per request step, and per replica
        # step (one pool call comes from one replica's step).
        hit: set[str] = set()
        for rid in request_ids:
            req = self._owner.get(rid)
            if req is None:
                continue
            req.drafter_failures += 1
            replica = self._placement.get(req)
            if replica is not None and replica.name not in hit:
                hit.add(replica.name)
                replica.scheduler.stats.drafter_failures += 1


async def _start_all(kind: str, numbers: itertools.count, n: int, factory,
                     errors: list[str]) -> list[tuple[str, tuple]]:
    """Starts ``n`` new ``kind-<number>`` members concurrently through ``factory``; returns
    ``(name, result)`` for those that started and appends one message per failure to
    ``errors`` (the others still join)."""
    names = [f"{kind}-{next(numbers)}" for _ in range(n)]
    results = await asyncio.gather(*(factory(name) for name in names), return_exceptions=True)
    started = []
    for name, result in zip(names, results, strict=True):
        if isinstance(result, BaseException):
            errors.append(f"starting {name} failed: {result!r}")
        else:
            started.append((name, result))
    return started
