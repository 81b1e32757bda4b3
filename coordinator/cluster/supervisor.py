"""Supervision of a `coordinator.cluster.router.Router` 's target replicas and drafter workers: what
follows a failure (`Supervision`: out of placement, requests moved or failed, re-created with
backoff) once it is recognised (`coordinator.cluster.failures`: `is_replica_death`,
`StallWatchdog`).

A replica whose target call finds it dead (a Ray actor error, its step channel
closed) or that misses the call's deadline (`StallWatchdog`: scaled by the replica's measured
step cost, capped by ``target_timeout_s``) is taken out of placement at once: the requests it
was decoding fail with `coordinator.step.errors.ReplicaUnavailable` (a message with no internals),
the ones it had not started move to a serving replica (or get the same error when none
serves), and it is re-created through the replica factory (fresh KV slots) under the same
name, retried with backoff while the factory fails. A replica that died while idle is found
the moment its step channel closes (`ChannelTarget.watch`), before a request is sent to it;
a periodic probe and every Status catch one whose transport cannot tell. A drafter that fails
``unhealthy_after`` calls in a row is marked unhealthy (`DrafterPool`), its requests move, and
it is replaced through the drafter factory. Health listeners (the gRPC health service) hear
whenever "some replica can serve" changes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..step.errors import REPLICA_FAILED, ReplicaFailed, ReplicaUnavailable
from .failures import death_summary, is_replica_death

if TYPE_CHECKING:
    from ..step.requests import ServiceRequest
    from .replica import MeteredTarget, Replica, ReplicaScheduler

log = logging.getLogger(__name__)

#: Longest wait between two attempts to re-create a failed replica or drafter, seconds.
MAX_RESTART_DELAY_S = 30.0


class Supervision:
    """The `coordinator.cluster.router.Router` 's supervision (a mixin: it works on the router's
    replicas, drafter pool and factories). Call `_init_supervision` from ``__init__``."""

    def _init_supervision(self, probe_interval_s: float | None, restart_delay_s: float) -> None:
        """``probe_interval_s``, ``restart_delay_s``: as `coordinator.cluster.router.Router` takes
        them."""
        self.probe_interval_s = probe_interval_s
        self.restart_delay_s = restart_delay_s
        self.pool.on_unhealthy = self._on_drafter_unhealthy
        self._restarts: dict[str, asyncio.Task] = {}  # name -> its re-creation task
        self._tasks: set[asyncio.Task] = set()  # watch / found-dead tasks in flight
        self._attempts: dict[str, asyncio.Task] = {}  # name -> the factory call in flight
        self._probe_task: asyncio.Task | None = None

    async def probe(self, timeout_s: float = 2.0) -> None:
        """Asks every serving replica for its ``status()``; one that answers with a death
        error is taken out of service and restarted (as a failed call would). So is an idle
        one (holding no request) whose status probes all went unanswered for longer than a
        call's deadline (`StallWatchdog`): frozen, found before a request waits on it. A
        busy replica's silence is left to its calls' deadlines."""
        async def one(replica: Replica) -> None:
            target = replica.target
            try:
                replica.reported = await asyncio.wait_for(target.replica_status(), timeout_s)
                replica.silent_since = None
            except Exception as exc:  # never fail Status over metrics
                if replica.target is not target:
                    return  # replaced meanwhile
                if is_replica_death(exc):
                    log.debug("replica %s: status probe found it dead: %s", replica.name, exc)
                    target.mark_failed(f"status probe: {death_summary(exc)}")
                    await self._found_dead(replica)
                elif isinstance(exc, TimeoutError):
                    await self._silent(replica, time.monotonic() - timeout_s)
                else:
                    log.warning("replica %s status failed: %r", replica.name, exc)

        await asyncio.gather(*(one(r) for r in list(self.replicas.values())
                               if not r.target.failed))

    def _on_replica_failure(self, scheduler: ReplicaScheduler,
                            unstarted: list[ServiceRequest]) -> str:
        """`ReplicaScheduler` ``on_failure``: out of placement now, re-created in the
        background, its unstarted requests placed on serving replicas (or failed). Returns
        what happens to the replica, for its failure's log line."""
        after = "it was draining: it is removed"
        replica = self.replicas.get(scheduler.name)
        if replica is not None and replica.scheduler is scheduler and \
                replica.state == "serving":
            after = "re-creating it"
            replica.state = "restarting"
            self._restarts[replica.name] = asyncio.get_running_loop().create_task(
                self._restart_replica(replica))
        # (a draining replica that fails is just removed: its drain ends with its requests)
        self._health_changed()
        for req in unstarted:
            serving = self.serving()
            if not serving:
                scheduler.stats.failed += 1
                req.events.put_nowait(ReplicaUnavailable(REPLICA_FAILED))
                continue
            other = min(serving, key=lambda r: (*r.scheduler.load(), r.scheduler.placed))
            other.scheduler.adopt(req)
            self._placement[req] = other
            log.info("request %s moved from failed replica %s to %s", req.id, scheduler.name,
                     other.name)
        return after

    async def _silent(self, replica: Replica, since: float) -> None:
        """A status probe of ``replica`` sent at ``since`` went unanswered: an idle replica
        silent for longer than a call's deadline is taken for stalled."""
        target = replica.target
        if replica.scheduler.requests or target.watchdog is None:
            replica.silent_since = None  # busy: its calls' deadlines judge it
            return
        if replica.silent_since is None:
            replica.silent_since = since
        silent = time.monotonic() - replica.silent_since
        limit = target.watchdog.deadline_s(0)
        if silent >= limit and not target.failed:
            target.mark_failed(f"stalled: idle, its status probes unanswered for {silent:.3g} s "
                               f"(a call's deadline is {limit:.3g} s)")
            await self._found_dead(replica)

    def _watch(self, replica: Replica) -> None:
        """Has a replica whose transport can tell (`target_worker.channel.ChannelTarget.
        watch`) report its death the moment its connection closes, so an idle replica that
        died is out of placement (and restarting) before a request is sent to it, rather
        than at the next probe."""
        target = replica.target
        watch = getattr(target.inner, "watch", None)
        if watch is None:
            return

        def closed(why: str) -> None:
            # Not a replica replaced or removed (stopping it closes the channel).
            if replica.target is target and self.replicas.get(replica.name) is replica:
                target.mark_failed(f"its step channel closed: {why}")  # -> `_failed`

        async def arm() -> None:
            try:
                await watch(closed)
            except Exception as exc:  # its first call (or the probe) finds out instead
                log.warning("replica %s: watching its channel failed: %r", replica.name, exc)

        self._spawn(arm())

    def _spawn(self, coro) -> None:
        """Runs ``coro`` as a task the router keeps until it ends."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _failed(self, name: str, target: MeteredTarget) -> None:
        """``target`` was marked failed: `_found_dead` for its replica, unless replaced."""
        replica = self.replicas.get(name)
        if replica is not None and replica.target is target:
            await self._found_dead(replica)

    async def _found_dead(self, replica: Replica) -> None:
        """A probe found ``replica``'s process gone. An idle replica is handled here; a busy
        one's loop finds out at its next target call (which now fails at once)."""
        scheduler = replica.scheduler
        if not scheduler.requests:
            await scheduler._on_target_failure(ReplicaFailed(replica.target.failure), [])
        else:
            scheduler._wakeup.set()

    async def _restart_replica(self, replica: Replica) -> None:
        try:
            await replica.scheduler.close()  # its loop has ended or waits idle; nothing in it
            await self._stop_replica(replica)  # frees the dead one's resources first

            def attempt_failed() -> None:
                replica.state = "failed"

            target, stop, info = await self._recreate(replica.name, self.replica_factory,
                                                      attempt_failed)
            from ..step.adaptive import restarted_cost_model

            # Its fresh calibration ran beside the restart's own work: per size, the lower of
            # it and what the dead incarnation had learnt (why: `restarted_cost_model`).
            previous = replica.scheduler.cost_model
            if info.get("cost_model") is not None and previous is not None:
                info = {**info, "cost_model": restarted_cost_model(info["cost_model"],
                                                                   previous)}
            self._retire(replica.scheduler)
            replica.target, replica.scheduler = self._new_scheduler(replica.name, target, info)
            replica.stop, replica.info, replica.reported = stop, dict(info), {}
            replica.silent_since = None
            self._watch(replica)
            replica.restarts += 1
            replica.state = "serving"
            replica.scheduler.start()
            log.warning("replica %s restarted (restart %d), serving again", replica.name,
                        replica.restarts)
            self._health_changed()
        finally:
            self._restarts.pop(replica.name, None)

    async def _recreate(self, name: str, factory, attempt_failed: Callable[[], None]):
        """``factory(name)``, retried with backoff until it succeeds (cancellable). The call
        in flight is kept in ``_attempts`` so a cancellation can stop what it started."""
        delay = self.restart_delay_s
        while True:
            attempt = self._attempts[name] = asyncio.ensure_future(factory(name))
            try:
                result = await attempt
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                del self._attempts[name]
                log.warning("re-creating %s failed (retrying in %.1f s): %r", name, delay, exc)
                attempt_failed()
                await asyncio.sleep(delay)
                delay = min(2 * delay, MAX_RESTART_DELAY_S)
                continue
            del self._attempts[name]
            return result

    async def _cancel_restart(self, name: str) -> None:
        """Stops re-creating ``name``; a worker its last attempt started but that was never
        installed is stopped."""
        task = self._restarts.pop(name, None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        attempt = self._attempts.pop(name, None)
        if attempt is not None and attempt.done() and not attempt.cancelled() \
                and attempt.exception() is None:
            try:
                await attempt.result()[1]()
            except Exception:
                log.exception("stopping an uninstalled %s failed", name)

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self.probe_interval_s)
            try:
                await self.probe()
            except Exception:
                log.exception("replica probe failed")

    def _on_drafter_unhealthy(self, name: str) -> None:
        """`DrafterPool` ``on_unhealthy``: replaces the worker in the background."""
        if self.drafter_factory is None or name in self._restarts:
            return
        self._restarts[name] = asyncio.get_running_loop().create_task(
            self._restart_drafter(name))

    async def _restart_drafter(self, name: str) -> None:
        try:
            await self.pool.stop_worker(name)
            # Checked as at a scale-up (`Router._start_drafter`): a replacement that wants
            # other hidden rows is refused, and retried with backoff.
            client, stop = await self._recreate(name, self._start_drafter, lambda: None)
            self.pool.replace(name, client, stop)
            log.warning("drafter %s replaced", name)
        finally:
            self._restarts.pop(name, None)

    async def _stop_replica(self, replica: Replica) -> None:
        stop, replica.stop = replica.stop, None
        if stop is not None:
            try:
                await stop()
            except Exception:
                log.exception("stopping replica %s failed", replica.name)
