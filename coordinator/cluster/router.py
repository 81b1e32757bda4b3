"""Target replicas (data parallel) behind one front end, and scaling while serving.

A `Router` runs one `ReplicaScheduler` (`coordinator.cluster.replica`) per target replica (each its
own continuous-batching loop and KV slots, the unchanged `Scheduler`), places each new request
on the least-loaded serving replica, and shares one `DrafterPool` among them. It has the
`Scheduler`'s ``submit`` / ``cancel`` / ``status`` so the Generation server drives either.
Its failed replicas and drafters are found and re-created by
`coordinator.cluster.supervisor.Supervision`.

`Router.scale` adds and removes replicas and drafters while requests run. A replica leaves by
draining: it stops getting requests, the ones it holds finish, then its loop stops and its
actors are destroyed. A drafter leaves at once; its requests continue on another one.

Metrics (`Router.status`): per replica, requests, tokens/s (last 10 s), mean wall time of a
verify call as the coordinator sees it, the replica's own forward time per call, and the
payload bytes of verify inputs and outputs per step (`payload_bytes`); per drafter, calls,
errors, latency, and its worker's cross-request cache size and proposals (`DrafterPool.refresh`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import weakref
from collections.abc import Awaitable, Callable, Sequence

from specd_core.request import SpeculativeOptions

from ..step.plan import ChunkPolicy
from ..step.requests import ServiceRequest
from ..step.targets import Target
from .config import check_count
from .drafter_pool import DrafterPool
from .failures import STALL_FACTOR, STALL_FLOOR_S
from .replica import MeteredTarget, Replica, ReplicaScheduler
from .supervisor import Supervision

log = logging.getLogger(__name__)

#: ``async (name) -> (target, stop, info)``: starts a replica; ``info`` is its ``model_info``
#: dict (plus anything to report, e.g. ``tp``, and its calibrated ``cost_model``, a
#: `coordinator.step.adaptive.ForwardCostModel`, which its loop then starts with); ``stop``
#: destroys it. Also used to re-create
#: a failed replica under its name; if cancelled it must not leave what it started running.
ReplicaFactory = Callable[[str], Awaitable[tuple[Target, Callable[[], Awaitable[None]], dict]]]
#: ``async (name) -> (client, stop)``: starts a drafter worker and a client for it (also to
#: replace an unhealthy one; the same cancellation rule).
DrafterFactory = Callable[[str], Awaitable[tuple[object, Callable[[], Awaitable[None]]]]]


_GAUGES = ("active_requests", "prefilling_requests", "waiting_requests", "used_slots",
           "total_slots")
_COUNTERS = ("steps", "tokens_generated", "forward_calls", "drafter_failures", "completed",
             "cancelled", "failed", "draft_wait_seconds", "runahead_hits", "runahead_misses",
             "active_seconds", "forced_tokens", "grammar_rejected_tokens", "pipelined_steps",
             "serial_steps", "undrafted_steps", "schedule_switches")


class Router(Supervision):
    """Target replicas and a drafter pool behind the `Scheduler` interface.

    Args:
        replica_factory: starts a replica (see `ReplicaFactory`).
        drafter_factory: starts a drafter worker (see `DrafterFactory`), or None for a
            service without drafters.
        max_active: requests decoding at once per replica.
        drafter_pool: the pool to use (default: a new one).
        adaptive: choose each request's draft length per step (`Scheduler` ``adaptive``);
            each replica calibrates its own forward cost unless ``cost_model`` is given.
        cost_model: a `coordinator.step.adaptive.ForwardCostModel` shared by every replica
            (tests); None calibrates per replica.
        target_timeout_s: the most one target call (a prefill or verify of a full batch
            included) may take, seconds; a replica that misses its call's deadline is
            treated as dead. The deadline is scaled by the replica's measured step cost
            (`StallWatchdog`: ``stall_factor`` x the call's predicted time, at least
            ``stall_floor_s``) and capped by this. None: no deadline (death errors are
            still detected).
        stall_factor, stall_floor_s: see `StallWatchdog`.
        probe_interval_s: how often idle replicas are asked for their status to find one
            that died while idle, seconds; None: only on `refresh` and `scale`.
        restart_delay_s: wait after a failed re-creation attempt (doubling, at most
            `coordinator.cluster.supervisor.MAX_RESTART_DELAY_S`), seconds.
        pipeline: every replica loop's step schedule (`Scheduler` ``pipeline``: True,
            False or ``"auto"``, each replica measuring for itself).
        chunking, prefix_caching: every replica loop's chunked prefill policy and prefix
            reuse (`Scheduler`).
    """

    def __init__(self, replica_factory: ReplicaFactory,
                 drafter_factory: DrafterFactory | None = None, max_active: int = 32,
                 drafter_pool: DrafterPool | None = None, adaptive: bool = True,
                 cost_model=None, target_timeout_s: float | None = None,
                 probe_interval_s: float | None = 5.0, restart_delay_s: float = 1.0,
                 pipeline: bool | str = False, chunking: ChunkPolicy | None = None,
                 prefix_caching: bool = True, stall_factor: float = STALL_FACTOR,
                 stall_floor_s: float = STALL_FLOOR_S):
        if target_timeout_s is not None and not target_timeout_s > 0:
            raise ValueError(f"target_timeout_s must be > 0, got {target_timeout_s!r}")
        if not stall_factor > 1 or not stall_floor_s > 0:
            raise ValueError(f"stall_factor must be > 1 and stall_floor_s > 0, got "
                             f"{stall_factor!r}, {stall_floor_s!r}")
        self.stall_factor, self.stall_floor_s = stall_factor, stall_floor_s
        self.replica_factory = replica_factory
        self.adaptive = adaptive
        self.pipeline = pipeline
        self.chunking = chunking
        self.prefix_caching = prefix_caching
        self.cost_model = cost_model
        self.drafter_factory = drafter_factory
        self.max_active = max_active
        self.target_timeout_s = target_timeout_s
        self.pool = drafter_pool or DrafterPool()
        self.pool.on_failure = self._on_drafter_failure
        self._init_supervision(probe_interval_s, restart_delay_s)
        self._health_listeners: list[Callable[[bool], None]] = []
        self._health: bool | None = None
        self.replicas: dict[str, Replica] = {}
        self.wants_hidden = False
        #: Which hidden rows the drafters read (`DrafterInfo.hidden_layers`: () the final-norm
        #: rows), known with ``wants_hidden`` from the first drafter that answers Info; every
        #: later drafter must declare the same (`_start_drafter`).
        self.hidden_layers: tuple[int, ...] = ()
        #: The drafter's own cap on one proposal (its `DrafterInfo`), None until known.
        self.drafter_max_len: int | None = None
        #: The drafter keeps a cross-request cache: finished outputs go to every worker.
        self.remember_outputs = False
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

    def can_serve(self) -> bool:
        """Whether some replica takes new requests (health: SERVING)."""
        return bool(self.serving())

    def add_health_listener(self, listener: Callable[[bool], None]) -> None:
        """Calls ``listener(can_serve)`` now and whenever `can_serve` changes (on the event
        loop; it must not block)."""
        self._health_listeners.append(listener)
        listener(self.can_serve())

    def submit(self, prompt_tokens: Sequence[int], options: SpeculativeOptions,
               speculate: bool = True, max_draft_len: int | None = None,
               partition: str = "") -> ServiceRequest:
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
        req = replica.scheduler.submit(prompt_tokens, options, speculate, max_draft_len,
                                       partition=partition)
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
        per replica, see `replica_status`) and ``drafters`` (`DrafterPool.status`).

        The counters are the replica rows' sums (``tokens_generated``: the rows'
        ``tokens_emitted``, cancelled and failed requests' tokens included) plus what removed
        replicas and the earlier lives of re-created ones counted (a re-created replica's row
        starts again at 0), so a total never goes backwards."""
        replicas = [self.replica_status(r) for r in self.replicas.values()]
        total = {key: sum(r[key] for r in replicas) for key in (*_GAUGES, *_COUNTERS)}
        for key, value in self._retired.items():  # counters never go back on a scale-down
            total[key] += value
        return {**total, "replicas": replicas, "drafters": self.pool.status()}

    def replica_status(self, replica: Replica) -> dict:
        """One replica's metrics (``node``: the IP of the Ray node its rank 0 runs on, from its
        factory's ``info``). Means are per verify call (one per step): ``step_seconds``
        (coordinator-side wall time, transport included), ``bytes_sent_per_step`` /
        ``bytes_received_per_step`` (`payload_bytes` of the verify items and outputs: token
        ids, positions, sampling parameters, target rows and hidden rows, 8 bytes per int or
        float, tensors their nbytes, pickle framing not counted); ``forward_seconds_per_call``
        is the replica's own forward time per forward call from its last ``status()`` (0 when
        unknown). Pipelining: ``draft_wait_seconds_per_step`` (mean time a step waited for
        drafts before its verify could start), ``runahead_hits`` / ``runahead_misses``, and
        ``target_busy_fraction``: the replica's own compute seconds (forward and rows, from
        its last ``status()``) over the seconds this loop had requests admitting or decoding,
        at most 1 (what coordination leaves idle is the rest). The step schedule
        (`coordinator.step.schedule`): ``pipeline`` (the current step's is pipelined),
        ``pipeline_mode`` (``auto``, ``on`` or ``off``), ``pipelined_steps`` /
        ``serial_steps`` / ``schedule_switches``, and ``schedule_costs`` (with ``auto``: per
        active-request bucket measured, seconds per committed token of each schedule,
        `ScheduleChooser.status`). Long prompts:
        ``prefilling_requests``, ``ttft_p50_seconds`` / ``ttft_p90_seconds``,
        ``itl_p50_seconds`` / ``itl_p90_seconds`` and ``prefill_p50_seconds`` over the
        latest requests (`coordinator.step.latency`), and the replica's prefix reuse counters
        and warm set (``prefix_copies``, ``warm_entries``, ``warm_positions``,
        ``warm_bytes``: `target_worker.engine.TargetEngine.stats`) from its last
        ``status()``."""
        s = replica.scheduler.status()
        schedule = s.pop("schedule")
        latency = replica.scheduler.latency
        m = replica.target.stats
        steps = m["verify_calls"]
        reported = replica.reported.get("stats", {})
        fwd_calls = reported.get("forward_calls", 0)
        busy = reported.get("forward_seconds", 0.0) + reported.get("rows_seconds", 0.0)
        return {
            "name": replica.name,
            "state": replica.state,
            "restarts": replica.restarts,
            "tp": int(replica.info.get("tp", 1)),
            "node": str(replica.info.get("node", "")),
            **s,
            "requests_placed": replica.scheduler.placed,
            "tokens_emitted": replica.scheduler.tokens_emitted,
            "tokens_per_second": replica.scheduler.meter.rate(),
            "step_seconds": m["verify_seconds"] / steps if steps else 0.0,
            "bytes_sent_per_step": m["verify_bytes_sent"] / steps if steps else 0.0,
            "bytes_received_per_step": m["verify_bytes_received"] / steps if steps else 0.0,
            "forward_seconds_per_call": (reported.get("forward_seconds", 0.0) / fwd_calls
                                         if fwd_calls else 0.0),
            "draft_wait_seconds_per_step": (s["draft_wait_seconds"] / s["steps"]
                                            if s["steps"] else 0.0),
            "target_busy_fraction": (min(1.0, busy / s["active_seconds"])
                                     if s["active_seconds"] else 0.0),
            "pipeline": replica.scheduler.pipeline,
            "pipeline_mode": schedule["mode"],
            "schedule_costs": [
                {"active_requests": c["active"],
                 "pipelined_seconds_per_token": c["pipelined"],
                 "serial_seconds_per_token": c["serial"],
                 "undrafted_seconds_per_token": c.get("undrafted", 0.0), "best": c["best"]}
                for c in schedule["costs"]],
            **{f"{name}_p{q}_seconds": getattr(latency, name).quantile(q / 100)
               for name, q in (("ttft", 50), ("ttft", 90), ("itl", 50), ("itl", 90),
                               ("prefill", 50))},
            **{key: int(reported.get(key, 0))
               for key in ("prefix_hits", "prefix_queries", "prefix_hit_tokens",
                           "prefix_copies", "warm_entries", "warm_positions", "warm_bytes")},
            **{f"target_{k}": v for k, v in m.items()},
        }

    async def refresh(self, timeout_s: float = 2.0) -> None:
        """Fetches each replica's own ``status()`` (forward time) and each drafter worker's
        `DrafterStats` (`DrafterPool.refresh`: cache size, proposals) for `status`,
        concurrently; one that does not answer in time keeps its previous report (a busy
        replica answers after its forward); a replica whose process is gone is taken out of
        service (`probe`)."""
        await asyncio.gather(self.probe(timeout_s), self.pool.refresh(timeout_s))

    # ---- scaling ----

    async def scale(self, target_replicas: int | None = None, drafters: int | None = None
                    ) -> dict:
        """Brings the counts of serving replicas and drafters to the given values (None keeps
        one as is) and returns ``{"target_replicas", "drafters", "added", "removed"}``.

        Drafters are added first (new replicas may then ask them whether they want hidden
        rows). Replicas to remove are the least loaded ones; each drains before it is
        destroyed, so this returns only when their requests have finished. A replica or
        drafter being re-created after a failure counts toward its count (it comes back) and
        is the first to go on a scale-down (a healthy one never leaves while a failed one
        stays). Scale calls run one at a time.

        Raises:
            ValueError: a count below 1 (replicas) or 0 (drafters), above
                `coordinator.cluster.config.MAX_COUNT`, not an integer, or drafters > 0 on a service
                without a drafter. Nothing changes.
            RuntimeError: starting a replica or drafter failed (the others that started are
                kept; the message names the failure: a drafter wanting other hidden rows than
                the service's drafters is refused, `_start_drafter`), or the drafters read
                layers the target does not have.
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
            errors.extend(self._layer_errors())
            if errors:
                raise RuntimeError("; ".join(errors))
            return {"target_replicas": len(self.serving()), "drafters": len(self.pool.serving()),
                    "added": added, "removed": removed}

    async def _scale_drafters(self, want: int, added: list, removed: list, errors: list) -> None:
        # A drafter being replaced counts as one: it comes back. It is removed first.
        have = [m for m in self.pool.members.values() if m.state != "leaving"]
        if want > len(have):
            started = await _start_all("drafter", self._drafter_names, want - len(have),
                                       self._start_drafter, errors)
            for name, (client, stop) in started:
                self.pool.add(name, client, stop)
                added.append(name)
        elif want < len(have):
            leaving = sorted(have, key=lambda m: (m.state == "serving", len(m.assigned),
                                                  m.in_flight))[:len(have) - want]
            for member in leaving:
                await self._cancel_restart(member.name)
            await asyncio.gather(*(self.pool.remove(m.name) for m in leaving))
            removed.extend(m.name for m in leaving)

    async def _scale_replicas(self, want: int, added: list, removed: list, errors: list) -> None:
        # A failed replica counts as one (it is being re-created); on a scale-down failed ones
        # leave first, and a probe first finds any that died while idle.
        def members() -> list[Replica]:
            return [r for r in self.replicas.values() if r.state != "draining"]

        if want < len(members()):
            await self.probe()
        have = members()
        if want > len(have):
            started = await _start_all("replica", self._replica_names, want - len(have),
                                       self.replica_factory, errors)
            for name, (target, stop, info) in started:
                self._add_replica(name, target, stop, info)
                added.append(name)
        elif want < len(have):
            def healthy(r: Replica) -> bool:
                return r.state == "serving" and not r.target.failed

            leaving = sorted(have, key=lambda r: (healthy(r), *r.scheduler.load())
                             )[:len(have) - want]
            for replica in leaving:
                if replica.state == "serving":
                    replica.state = "draining"
                else:  # decided now, before its re-creation can finish
                    replica.state = "failed"
                    task = self._restarts.get(replica.name)
                    if task is not None:
                        task.cancel()
            self._health_changed()
            await asyncio.gather(*(self._remove_replica(r) for r in leaving))
            removed.extend(r.name for r in leaving)

    async def _start_drafter(self, name: str) -> tuple[object, Callable[[], Awaitable[None]]]:
        """A drafter worker from the drafter factory (at a scale-up, and when a failed one is
        replaced), after its Info: the first to answer tells the service what the drafters
        want (hidden rows and which: ``wants_hidden``, ``hidden_layers``; their cap; whether
        they remember outputs), which every replica loop then uses; a later one that wants
        other hidden rows is stopped and refused (every worker of a service runs the same
        drafter, and a replica's steps capture one set of layers).

        Raises:
            ValueError: the worker's ``wants_hidden`` / ``hidden_layers`` differ from the
                service's drafters' (the message names both).
            DrafterUnavailable: its Info call failed. Either way the worker is stopped.
        """
        client, stop = await self.drafter_factory(name)
        try:
            info = await client.info()
            layers = tuple(info.hidden_layers) if info.wants_hidden else ()
            if not self._hidden_known:
                self._learn_drafter(info, layers)
            elif (info.wants_hidden, layers) != (self.wants_hidden, self.hidden_layers):
                def says(wants: bool, layers: tuple[int, ...]) -> str:
                    return ("no hidden rows" if not wants else f"hidden_layers {list(layers)}"
                            if layers else "the final-norm hidden rows")

                raise ValueError(
                    f"{name} ({info.name}) wants {says(info.wants_hidden, layers)} but the "
                    f"service's drafters want {says(self.wants_hidden, self.hidden_layers)}:"
                    " every drafter worker of a service must run the same drafter")
        except BaseException:
            try:
                close = getattr(client, "close", None)
                if close is not None:
                    await close()
            finally:
                if stop is not None:
                    await stop()
            raise
        return client, stop

    def _layer_errors(self) -> list[str]:
        """Why the drafters' ``hidden_layers`` do not fit the replicas (whose ``info``
        reports ``n_layers``): a layer beyond the target's last; empty when they fit. Every
        step wanting rows would be refused, so `scale` reports it."""
        if not self.hidden_layers:
            return []
        errors = []
        for replica in self.replicas.values():
            n = replica.info.get("n_layers")
            if n is not None and self.hidden_layers[-1] > int(n):
                errors.append(f"the drafters read hidden_layers {list(self.hidden_layers)} but "
                              f"replica {replica.name}'s target has {n} layers (layers 0.."
                              f"{n} can be read)")
        return errors

    def _learn_drafter(self, info, layers: tuple[int, ...]) -> None:
        """What the drafters want (the first drafter's `DrafterInfo`), for every replica
        loop, present and future."""
        self.wants_hidden = info.wants_hidden
        self.hidden_layers = layers
        self.drafter_max_len = info.max_draft_len or None
        self.remember_outputs = info.remembers_outputs
        self._hidden_known = True
        for replica in self.replicas.values():
            replica.scheduler.wants_hidden = self.wants_hidden
            replica.scheduler.hidden_layers = self.hidden_layers
            replica.scheduler.drafter_max_len = self.drafter_max_len
            replica.scheduler.remember_outputs = self.remember_outputs

    def _new_scheduler(self, name: str, target: Target, info: dict
                       ) -> tuple[MeteredTarget, ReplicaScheduler]:
        """A metered target and loop for a replica; ``info["cost_model"]``, when the factory
        calibrated the replica's forward cost, is taken out of ``info`` for the loop."""
        cost_model = info.pop("cost_model", None) or self.cost_model
        metered = MeteredTarget(target, self.target_timeout_s, self.stall_factor,
                                self.stall_floor_s)
        # However the failure is found, the replica leaves placement: a failure only a
        # ``free`` met (the replica died just after a request finished) would otherwise
        # wait for the next request, which it would fail.
        metered.on_failed = lambda: self._spawn(self._failed(name, metered))
        scheduler = ReplicaScheduler(name, metered, self.pool, self._ids,
                                     max_active=self.max_active, wants_hidden=self.wants_hidden,
                                     adaptive=self.adaptive, cost_model=cost_model,
                                     pipeline=self.pipeline,
                                     on_failure=self._on_replica_failure,
                                     chunking=self.chunking,
                                     prefix_caching=self.prefix_caching,
                                     hidden_layers=self.hidden_layers)
        scheduler.drafter_max_len = self.drafter_max_len
        scheduler.remember_outputs = self.remember_outputs
        return metered, scheduler

    def _add_replica(self, name: str, target: Target, stop, info: dict) -> Replica:
        metered, scheduler = self._new_scheduler(name, target, info)
        replica = self.replicas[name] = Replica(name, scheduler, metered, stop, dict(info))
        self._watch(replica)
        scheduler.start()
        if self._probe_task is None and self.probe_interval_s is not None:
            self._probe_task = asyncio.get_running_loop().create_task(self._probe_loop())
        self._health_changed()
        return replica

    async def _remove_replica(self, replica: Replica) -> None:
        """Removes a draining replica once drained, or a failed one at once."""
        if replica.state == "draining":
            await replica.scheduler.drain()
        else:  # failed: nothing runs on it
            await self._cancel_restart(replica.name)
            await replica.scheduler.close()
        self._retire(replica.scheduler)
        del self.replicas[replica.name]
        await self._stop_replica(replica)
        self._health_changed()

    def _retire(self, scheduler: ReplicaScheduler) -> None:
        final = scheduler.status()
        for key in _COUNTERS:
            self._retired[key] += final[key]

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
        if self._probe_task is not None:
            self._probe_task.cancel()
            await asyncio.gather(self._probe_task, return_exceptions=True)
            self._probe_task = None
        for name in list(self._restarts):
            await self._cancel_restart(name)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for replica in list(self.replicas.values()):
            await replica.scheduler.close()
            self.replicas.pop(replica.name, None)
            await self._stop_replica(replica)
        await self.pool.close()

    # ---- health, and drafter failures ----

    def _health_changed(self) -> None:
        now = self.can_serve()
        if now != self._health:
            self._health = now
            if not now:
                log.error("no target replica can serve: new requests get UNAVAILABLE")
            for listener in self._health_listeners:
                listener(now)

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
