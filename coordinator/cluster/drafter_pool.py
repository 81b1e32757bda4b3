"""Several drafter workers behind the one-drafter client interface the scheduler uses.

A `DrafterPool` has `DrafterClient`'s ``propose`` / ``release`` / ``info`` / ``stats``, so a
`Scheduler` drives N drafters exactly as it drives one. Assignment is **sticky per request**:
a request's first proposal goes to the drafter with the fewest requests (then fewest calls in
flight), and it stays there until that drafter is removed or fails a call. Why sticky rather
than least-outstanding per call: the worker keeps each request's history (and a model drafter
its own KV cache) so a step ships only the new tokens; moving a request costs a full-history
resend and, for a model drafter, recomputing its cache. Load still spreads, because every new
request lands on the least-loaded drafter.

Supervision: a member whose calls fail ``unhealthy_after`` times in a row is marked
``"unhealthy"``: it gets no requests (its own move to the others) and ``on_unhealthy`` is told,
so the owner (`coordinator.cluster.router.Router`) can `stop_worker` it and `replace` it with a
fresh worker under the same name (its counters carry on).

Cross-request caches (suffix decoding) are **replicated**: `remember` sends every finished
output (with its partition: tenant and ``cache_salt``) to every serving member, so no
routing for locality is needed.

Moving a request is always safe: the new drafter's client does not know the id, so its first
call sends the whole history (``known = 0``), and drafts never change a greedy output (the
rejection rule keeps sampled outputs distributed as the target's).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from drafter_worker.client import DrafterInfo, DrafterStats, DrafterUnavailable, ProposeJob
from specd_core.draft import DraftBlock

log = logging.getLogger(__name__)


@dataclass(eq=False)
class PoolMember:
    """One drafter worker in the pool.

    Attributes:
        name: the pool's name for it (``"drafter-0"``...).
        client: its `DrafterClient` (or anything with the same async methods and ``stats``).
        stop: awaited after the member leaves the pool (kills the worker), or None.
        state: ``"serving"``, ``"unhealthy"`` (failing; gets no requests until replaced) or
            ``"leaving"`` (gets no requests; in-flight calls finish).
        assigned: request ids whose proposals go to this member.
        in_flight: Propose calls now outstanding.
        consecutive_errors: failed calls since its last success (> 0 puts it last in line).
    """

    name: str
    client: object
    stop: Callable[[], Awaitable[None]] | None = None
    state: str = "serving"
    assigned: set[str] = field(default_factory=set)
    in_flight: int = 0
    consecutive_errors: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    restarts: int = 0
    #: ``calls``, ``errors``, ``latency_s`` of the workers this member had before (replaced).
    retired: dict = field(default_factory=lambda: {"calls": 0, "errors": 0, "latency_s": 0.0})
    #: Its worker's last `DrafterStats` (`DrafterPool.refresh`), None before the first.
    reported: DrafterStats | None = None
    #: ``proposals``, ``global_hits`` last reported by the workers it had before (replaced).
    retired_drafts: dict = field(default_factory=lambda: {"proposals": 0, "global_hits": 0})

    def __post_init__(self) -> None:
        self.idle.set()

    def status(self) -> dict:
        """``name, address, state, calls, errors, latency_s`` (summed seconds),
        ``mean_latency_s, assigned_requests, in_flight, restarts, node`` (the IP of the Ray
        node its worker runs on, "" when unknown); the counters include
        the workers it replaced. From its worker's last `DrafterStats` (`DrafterPool.refresh`;
        zeros before one): ``has_cache``, ``cache_outputs``, ``cache_tokens``,
        ``cache_nodes``, ``cache_bytes`` (approximate), ``cache_evicted``,
        ``cache_partitions`` (its current worker's cache, totals over its partitions; their
        number, never their names), ``proposals`` and ``global_hits`` (with the replaced
        workers' last reported counts)."""
        s = self.stats()
        calls = int(s["calls"])
        r = self.reported or DrafterStats()
        return {
            "name": self.name,
            "address": str(getattr(self.client, "address", "")),
            "state": self.state,
            "calls": calls,
            "errors": int(s["errors"]),
            "latency_s": float(s["latency_s"]),
            "mean_latency_s": float(s["latency_s"]) / calls if calls else 0.0,
            "assigned_requests": len(self.assigned),
            "in_flight": self.in_flight,
            "restarts": self.restarts,
            "node": str(getattr(self.client, "node", "")),
            "has_cache": r.has_cache,
            "cache_outputs": r.cache_outputs,
            "cache_tokens": r.cache_tokens,
            "cache_nodes": r.cache_nodes,
            "cache_bytes": r.cache_bytes,
            "cache_evicted": r.cache_evicted,
            "cache_partitions": r.cache_partitions,
            "proposals": r.proposals + self.retired_drafts["proposals"],
            "global_hits": r.global_hits + self.retired_drafts["global_hits"],
        }

    def stats(self) -> dict:
        """``calls``, ``errors``, ``latency_s`` of its current worker plus retired ones."""
        now = self.client.stats
        return {key: value + now.get(key, 0) for key, value in self.retired.items()}


class DrafterPool:
    """Drafter workers that can join and leave while requests run.

    Args:
        on_failure: called with the request ids whose proposal failed in a call (they decode
            that step without drafts); the router uses it for per-request counters.
        unhealthy_after: consecutive failed calls that mark a member unhealthy (>= 1).
        on_unhealthy: called with a member's name when it is marked unhealthy.
    """

    def __init__(self, on_failure: Callable[[list[str]], None] | None = None,
                 unhealthy_after: int = 3, on_unhealthy: Callable[[str], None] | None = None):
        if isinstance(unhealthy_after, bool) or not isinstance(unhealthy_after, int) or \
                unhealthy_after < 1:
            raise ValueError(f"unhealthy_after must be an int >= 1, got {unhealthy_after!r}")
        self.members: dict[str, PoolMember] = {}
        self.on_failure = on_failure
        self.unhealthy_after = unhealthy_after
        self.on_unhealthy = on_unhealthy
        self._owner: dict[str, PoolMember] = {}
        self._order = itertools.count()
        self._rank: dict[str, int] = {}

    # ---- membership ----

    def add(self, name: str, client, stop: Callable[[], Awaitable[None]] | None = None
            ) -> PoolMember:
        """Adds a serving member.

        Raises:
            ValueError: the name is taken.
        """
        if name in self.members:
            raise ValueError(f"drafter {name!r} is already in the pool")
        member = self.members[name] = PoolMember(name, client, stop)
        self._rank[name] = next(self._order)
        return member

    def serving(self) -> list[PoolMember]:
        return [m for m in self.members.values() if m.state == "serving"]

    async def remove(self, name: str) -> None:
        """Takes a member out: no new calls go to it, its requests move to other members at
        their next step (full-history resend), its in-flight calls finish (or time out),
        then its client closes and ``stop`` runs.

        Raises:
            KeyError: no such member.
        """
        member = self.members[name]
        member.state = "leaving"
        for rid in list(member.assigned):
            self._unassign(rid)
        await member.idle.wait()
        del self.members[name]
        try:
            await member.client.close()
        finally:
            if member.stop is not None:
                await member.stop()

    async def stop_worker(self, name: str) -> None:
        """Stops an unhealthy member's worker (after its in-flight calls end) and closes its
        client; the member stays, unhealthy, until `replace`.

        Raises:
            KeyError: no such member.
        """
        member = self.members[name]
        await member.idle.wait()
        stop, member.stop = member.stop, None
        try:
            await member.client.close()
        finally:
            if stop is not None:
                await stop()

    def replace(self, name: str, client, stop: Callable[[], Awaitable[None]] | None = None
                ) -> None:
        """Gives member ``name`` a fresh worker: it serves again (requests assigned anew send
        their whole history), its old worker's counters kept in ``retired``.

        Raises:
            KeyError: no such member.
        """
        member = self.members[name]
        for key, value in member.client.stats.items():
            if key in member.retired:
                member.retired[key] += value
        if member.reported is not None:  # the new worker's cache starts empty
            member.retired_drafts["proposals"] += member.reported.proposals
            member.retired_drafts["global_hits"] += member.reported.global_hits
            member.reported = None
        member.client, member.stop = client, stop
        member.consecutive_errors = 0
        member.restarts += 1
        member.state = "serving"

    async def close(self) -> None:
        """Removes every member."""
        for name in list(self.members):
            try:
                await self.remove(name)
            except Exception:
                log.exception("stopping drafter %s failed", name)

    # ---- the DrafterClient interface ----

    async def info(self) -> DrafterInfo:
        """The first serving member's `DrafterInfo` (all members run the same drafter kind).

        Raises:
            DrafterUnavailable: no member, or its Info call failed.
        """
        serving = self.serving()
        if not serving:
            raise DrafterUnavailable("the drafter pool is empty")
        return await serving[0].client.info()

    @property
    def stats(self) -> dict:
        """Summed over current members: ``calls``, ``errors``, ``latency_s``."""
        total = {"calls": 0, "errors": 0, "latency_s": 0.0}
        for m in self.members.values():
            for key, value in m.stats().items():
                total[key] += value
        return total

    def status(self) -> list[dict]:
        """`PoolMember.status` of every member, in the order they joined."""
        return [m.status() for m in sorted(self.members.values(),
                                           key=lambda m: self._rank[m.name])]

    async def refresh(self, timeout_s: float = 2.0) -> None:
        """Asks every serving member's worker for its `DrafterStats` (cache size, proposal
        counters) for `status`. A worker that does not answer within ``timeout_s`` seconds
        (or its client's deadline), fails, or has no ``drafter_stats`` keeps its previous
        report; never raises. The workers answer off their drafting thread, so a busy one
        answers at once."""
        async def one(member: PoolMember) -> None:
            client = member.client
            try:
                stats = await asyncio.wait_for(client.drafter_stats(), timeout_s)
            except Exception as exc:  # never fail Status over metrics; the numbers go stale
                log.debug("drafter %s: stats not refreshed: %r", member.name, exc)
                return
            if member.client is client:  # not replaced meanwhile
                member.reported = stats

        await asyncio.gather(*(one(m) for m in self.serving()
                               if callable(getattr(m.client, "drafter_stats", None))))

    async def propose(self, jobs: Sequence[ProposeJob]) -> list[DraftBlock]:
        """One block per job, in order. Jobs are grouped by their request's drafter and the
        groups proposed concurrently. A group whose call fails gets empty blocks (reported to
        ``on_failure``) and its requests are unassigned, so their next step picks a drafter
        afresh; the other groups are unaffected. With no drafter, every block is empty.

        Raises:
            ValueError: from `DrafterClient.propose` (bad jobs); nothing is sent.
        """
        blocks = [DraftBlock.empty() for _ in jobs]
        if not jobs or not self.serving():
            return blocks
        groups: dict[str, list[int]] = {}
        for i, job in enumerate(jobs):
            groups.setdefault(self._owner_of(job.request_id).name, []).append(i)
        members = [self.members[name] for name in groups]
        results = await asyncio.gather(
            *(self._call(m, [jobs[i] for i in groups[m.name]]) for m in members),
            return_exceptions=True)
        failed: list[str] = []
        for member, result in zip(members, results, strict=True):
            where = groups[member.name]
            if isinstance(result, DrafterUnavailable):
                log.warning("drafter %s failed; %d request(s) decode this step undrafted: %s",
                            member.name, len(where), result)
                ids = [jobs[i].request_id for i in where]
                for rid in ids:
                    self._unassign(rid)
                failed.extend(ids)
                if member.consecutive_errors >= self.unhealthy_after and \
                        member.state == "serving":
                    self._mark_unhealthy(member)
                continue
            if isinstance(result, BaseException):
                raise result
            for i, block in zip(where, result, strict=True):
                blocks[i] = block
        if failed and self.on_failure is not None:
            self.on_failure(failed)
        return blocks

    async def release(self, request_ids: Sequence[str]) -> None:
        """Forgets the ids on their drafters (best effort, never raises)."""
        by_member: dict[str, list[str]] = {}
        for rid in request_ids:
            member = self._owner.get(rid)
            self._unassign(rid)
            if member is not None and member.name in self.members:
                by_member.setdefault(member.name, []).append(rid)
        for name, ids in by_member.items():
            await self.members[name].client.release(ids)

    async def remember(self, outputs: Sequence[Sequence[int]],
                       partitions: Sequence[str] | None = None) -> None:
        """Sends finished outputs, output ``i`` for partition ``partitions[i]`` (None: all
        shared, ""), to every serving member (best effort, never raises), so each worker's
        cross-request cache (suffix decoding) holds every request's output whichever worker
        drafted it: a request's hit rate does not depend on which worker it lands on, and
        placement stays free for load balancing."""
        if not outputs:
            return
        partitions = [""] * len(outputs) if partitions is None else list(partitions)
        members = self.serving()
        results = await asyncio.gather(*(m.client.remember(outputs, partitions)
                                         for m in members
                                         if callable(getattr(m.client, "remember", None))),
                                       return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                log.warning("sending outputs to a drafter failed: %r", result)

    # ---- internals ----

    def _owner_of(self, rid: str) -> PoolMember:
        member = self._owner.get(rid)
        if member is None or member.state != "serving":
            member = min(self.serving(), key=lambda m: (
                m.consecutive_errors > 0, len(m.assigned), m.in_flight, self._rank[m.name]))
            self._owner[rid] = member
            member.assigned.add(rid)
        return member

    def _mark_unhealthy(self, member: PoolMember) -> None:
        log.error("drafter %s failed %d calls in a row: marked unhealthy, its requests move",
                  member.name, member.consecutive_errors)
        member.state = "unhealthy"
        for rid in list(member.assigned):
            self._unassign(rid)
        if self.on_unhealthy is not None:
            self.on_unhealthy(member.name)

    def _unassign(self, rid: str) -> None:
        member = self._owner.pop(rid, None)
        if member is not None:
            member.assigned.discard(rid)

    async def _call(self, member: PoolMember, jobs: list[ProposeJob]) -> list[DraftBlock]:
        member.in_flight += 1
        member.idle.clear()
        try:
            blocks = await member.client.propose(jobs)
        except DrafterUnavailable:
            member.consecutive_errors += 1
            raise
        finally:
            member.in_flight -= 1
            if member.in_flight == 0:
                member.idle.set()
        member.consecutive_errors = 0
        return blocks
