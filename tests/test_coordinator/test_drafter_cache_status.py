"""Drafter workers' own counters (cache size, proposals, global hits) through the coordinator:
the pool's refresh (a silent or failing worker keeps its last numbers, a replaced one's
proposals carry on), the Status RPC and Prometheus on a service of suffix drafter workers,
and zeros for prompt lookup."""

from __future__ import annotations

import asyncio
import importlib.util
import time
import urllib.request

import pytest
from service_harness import LocalService
from test_service import REPEATING, request, stream_tokens
from test_suffix_decoding import SuffixService

from coordinator.cluster.drafter_pool import DrafterPool
from drafter_worker.client import DrafterStats, DrafterUnavailable
from drafter_worker.sessions import DRAFTER_STATS
from specd.v1 import generation_pb2

# ---- the pool ----


class StatsClient:
    """A pool member's client that answers ``drafter_stats`` with ``answer``, or fails, or
    never answers (``mode``)."""

    def __init__(self, answer: DrafterStats, mode: str = "answer"):
        self.answer, self.mode = answer, mode
        self.stats = {"calls": 0, "errors": 0, "latency_s": 0.0}

    async def drafter_stats(self) -> DrafterStats:
        if self.mode == "hang":
            await asyncio.Event().wait()
        if self.mode == "fail":
            raise DrafterUnavailable("down")
        return self.answer

    async def close(self):
        pass


def cache(outputs: int, proposals: int, hits: int) -> DrafterStats:
    return DrafterStats(True, outputs, outputs * 10, outputs * 100, outputs * 8000, 0,
                        proposals, hits)


def test_refresh_updates_answering_members_and_keeps_the_last_numbers_of_the_others():
    async def go():
        pool = DrafterPool()
        a, b, c = (StatsClient(cache(n, 10 * n, n)) for n in (1, 2, 3))
        for name, client in (("a", a), ("b", b), ("c", c)):
            pool.add(name, client)
        before = {s["name"]: s for s in pool.status()}
        await pool.refresh()
        first = {s["name"]: s for s in pool.status()}
        a.answer, b.answer, c.answer = cache(4, 40, 4), cache(5, 50, 5), cache(6, 60, 6)
        b.mode, c.mode = "hang", "fail"
        start = time.monotonic()
        await pool.refresh(timeout_s=0.5)
        took = time.monotonic() - start
        return before, first, {s["name"]: s for s in pool.status()}, took

    before, first, second, took = asyncio.run(go())
    assert before["a"]["has_cache"] is False and before["a"]["cache_outputs"] == 0
    assert [first[n]["cache_outputs"] for n in "abc"] == [1, 2, 3]
    assert {k: first["c"][k] for k in ("has_cache", *DRAFTER_STATS)} == {
        "has_cache": True, "cache_outputs": 3, "cache_tokens": 30, "cache_nodes": 300,
        "cache_bytes": 24000, "cache_evicted": 0, "proposals": 30, "global_hits": 3,
        "cache_partitions": 0}
    assert took < 5  # the silent member cost the timeout, no more
    assert second["a"]["cache_outputs"] == 4 and second["a"]["proposals"] == 40
    for name in "bc":  # silent or failing: its previous numbers
        assert {k: second[name][k] for k in ("cache_outputs", "proposals", "global_hits")} == \
            {k: first[name][k] for k in ("cache_outputs", "proposals", "global_hits")}


def test_a_replaced_workers_proposals_carry_on_and_its_cache_is_not_reported_twice():
    async def go():
        pool = DrafterPool()
        pool.add("a", StatsClient(cache(7, 20, 5)))
        await pool.refresh()
        pool.members["a"].state = "unhealthy"
        pool.replace("a", StatsClient(cache(1, 3, 1)))
        replaced = pool.status()[0]
        await pool.refresh()
        return replaced, pool.status()[0]

    replaced, refreshed = asyncio.run(go())
    assert (replaced["cache_outputs"], replaced["proposals"], replaced["global_hits"]) == \
        (0, 20, 5)
    assert (refreshed["cache_outputs"], refreshed["proposals"], refreshed["global_hits"]) == \
        (1, 23, 6)


# ---- through the service ----

#: Greedy requests: the same prompts a second time draft from the first round's outputs.
ROUND = [request(REPEATING, max_new=24), request([11, 3, 40, 22, 17, 9, 31], max_new=24),
         request([2, 4, 2, 4, 2, 4], max_new=24)]


def status(svc) -> generation_pb2.StatusResponse:
    channel, stub = svc.stub()
    with channel:
        return stub.Status(generation_pb2.StatusRequest(), timeout=30)


async def _settle(svc) -> None:
    """Waits until every finished request's output has reached the drafter workers."""
    for replica in svc.router.replicas.values():
        await replica.scheduler.settle_drafter()


def run_round(svc) -> None:
    for req in ROUND:
        stream_tokens(svc, req)
    svc.call(_settle(svc))


def scrape(svc) -> str | None:
    """The service's Prometheus text (None without prometheus_client)."""
    if importlib.util.find_spec("prometheus_client") is None:
        return None
    from coordinator.cluster.metrics import start_exporter

    server, port = start_exporter(svc.router, svc.loop, "127.0.0.1", 0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
            return r.read().decode()
    finally:
        server.shutdown()


@pytest.fixture(scope="module")
def suffix_rounds():
    """Two suffix drafter workers, two rounds of `ROUND`: (service, Status after the first,
    Status after the second, Prometheus text after the second or None)."""
    svc = SuffixService(drafters=2).start()
    try:
        run_round(svc)
        first = status(svc)
        run_round(svc)
        second = status(svc)
        yield svc, first, second, scrape(svc)
    finally:
        svc.stop()


def test_status_reports_each_workers_cache_size_and_global_hits(suffix_rounds):
    svc, first, second, _ = suffix_rounds
    assert [d.name for d in second.drafters] == ["drafter-0", "drafter-1"]
    for d in first.drafters:  # every finished output reached every worker
        assert d.has_cache and d.cache_outputs == len(ROUND)
        assert d.cache_tokens > 0 and d.cache_nodes > 0 and d.cache_bytes > 0
    for d in second.drafters:
        assert d.cache_outputs == 2 * len(ROUND)
        assert d.cache_bytes >= d.cache_nodes > 0
    # The drafters' own counters, as their workers report them.
    own = svc.suffix_drafters
    assert sorted(d.proposals for d in second.drafters) == \
        sorted(x.stats()["proposals"] for x in own)
    assert sum(d.global_hits for d in second.drafters) == \
        sum(x.stats()["global_wins"] for x in own)
    assert sum(d.global_hits for d in second.drafters) > \
        sum(d.global_hits for d in first.drafters)
    assert sum(d.proposals for d in second.drafters) > 0


def test_prometheus_exports_each_workers_cache_and_hits(suffix_rounds):
    svc, _, second, text = suffix_rounds
    if text is None:
        pytest.skip("prometheus_client is not installed")
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    for d in second.drafters:
        label = f'{{drafter="{d.name}"}}'
        assert samples["specd_drafter_cache_outputs" + label] == 2 * len(ROUND)
        assert samples["specd_drafter_cache_bytes" + label] > 0
        assert samples["specd_drafter_proposals_total" + label] == d.proposals
        assert samples["specd_drafter_global_hits_total" + label] == d.global_hits
    assert sum(samples[f'specd_drafter_global_hits_total{{drafter="{d.name}"}}']
               for d in second.drafters) > 0


def test_a_prompt_lookup_worker_reports_zeros():
    svc = LocalService().start()
    try:
        tokens, _ = stream_tokens(svc, ROUND[0])
        assert tokens
        svc.call(_settle(svc))
        d, = status(svc).drafters
        assert d.calls > 0  # it drafted; no cache, no counters of its own
        assert not d.has_cache
        assert (d.cache_outputs, d.cache_tokens, d.cache_nodes, d.cache_bytes,
                d.cache_evicted, d.proposals, d.global_hits) == (0,) * 7
    finally:
        svc.stop()
