"""A drafter worker's own counters through the ``Stats`` RPC: a suffix drafter's cache size
and proposal counters reach the client, a drafter without a cache reports zeros, and Stats
answers while a proposal is still computing."""

from __future__ import annotations

import asyncio
import threading

import pytest

from drafter_worker.client import DrafterClient, DrafterStats, DrafterUnavailable, ProposeJob
from drafter_worker.prompt_lookup import PromptLookupSpeculator
from drafter_worker.server import start_drafter_server
from drafter_worker.sessions import DRAFTER_STATS, DrafterSessions
from drafter_worker.suffix import SuffixDrafter, SuffixTree
from specd_core.draft import DraftBlock, DrafterCapabilities

# Guards against a hung RPC stalling the suite; never reached by a passing test.
_SAFETY_S = 60

#: Three outputs of distinct tokens: a new request starting like one of them has no match in
#: its own tree, so only the cache (previous outputs) can draft it.
OUTPUTS = [list(range(10, 30)), list(range(30, 45)), list(range(50, 62))]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, _SAFETY_S))


def test_a_suffix_workers_cache_size_and_proposals_reach_the_client():
    drafter = SuffixDrafter(max_draft_len=4)

    async def go():
        server, port = await start_drafter_server(drafter)
        try:
            async with DrafterClient(f"127.0.0.1:{port}", timeout_s=10) as client:
                empty = await client.drafter_stats()
                await client.remember(OUTPUTS)
                # Starts like the first output: the cache drafts its continuation.
                hit, = await client.propose([ProposeJob("a", OUTPUTS[0][:8], 4)])
                miss, = await client.propose([ProposeJob("b", [70, 71, 72], 4)])
                return empty, hit, miss, await client.drafter_stats()
        finally:
            await server.stop(None)

    empty, hit, miss, stats = run(go())
    assert empty == DrafterStats(has_cache=True)
    assert list(hit.tokens) == OUTPUTS[0][8:12] and len(miss) == 0
    nodes = drafter.cache.partition("").tree.nodes
    assert nodes > 0
    assert stats == DrafterStats(
        has_cache=True, cache_outputs=3, cache_tokens=sum(map(len, OUTPUTS)), cache_nodes=nodes,
        cache_bytes=nodes * SuffixTree.BYTES_PER_NODE, cache_evicted=0, proposals=2,
        global_hits=1, cache_partitions=1)
    assert stats.global_hit_rate == 0.5


def test_evictions_are_reported():
    drafter = SuffixDrafter(max_draft_len=4, cache_requests=2)
    sessions = DrafterSessions(drafter)
    sessions.remember(OUTPUTS)
    s = sessions.stats()
    assert (s["cache_outputs"], s["cache_evicted"]) == (2, 1)
    assert s["cache_tokens"] == len(OUTPUTS[1]) + len(OUTPUTS[2])


def test_a_prompt_lookup_worker_reports_zeros_after_proposing():
    async def go():
        server, port = await start_drafter_server(PromptLookupSpeculator(2, 4))
        try:
            async with DrafterClient(f"127.0.0.1:{port}", timeout_s=10) as client:
                block, = await client.propose([ProposeJob("a", [1, 2, 3, 1, 2], 4)])
                return block, await client.drafter_stats()
        finally:
            await server.stop(None)

    block, stats = run(go())
    assert len(block) > 0  # it did propose: the counters are zero for want of a cache
    assert stats == DrafterStats()


class BlockingDrafter:
    """Holds its proposal until ``go`` is set (``entered`` says it started); reports fixed
    counters."""

    capabilities = DrafterCapabilities(wants_hidden=False, samples=False, remembers=True)

    def __init__(self):
        self.entered, self.go = threading.Event(), threading.Event()

    def propose(self, history, target_hidden, max_len):
        self.entered.set()
        self.go.wait(_SAFETY_S)
        return DraftBlock.empty()

    def remember(self, outputs, partitions):
        pass

    def stats(self):
        return {"proposals": 7, "global_wins": 3,
                "cache": {"outputs": 2, "tokens": 40, "nodes": 500, "approx_bytes": 40_000,
                          "evicted": 1}}


def test_stats_answers_while_a_proposal_is_still_computing():
    drafter = BlockingDrafter()

    async def go():
        server, port = await start_drafter_server(drafter)
        address = f"127.0.0.1:{port}"
        try:
            async with DrafterClient(address, timeout_s=_SAFETY_S) as proposer, \
                    DrafterClient(address, timeout_s=5) as reader:
                pending = asyncio.ensure_future(proposer.propose([ProposeJob("a", [1, 2], 4)]))
                assert await asyncio.to_thread(drafter.entered.wait, _SAFETY_S)
                try:
                    # Queued behind the proposal, this would miss its 5 s deadline.
                    return await reader.drafter_stats()
                finally:
                    drafter.go.set()
                    await pending
        finally:
            drafter.go.set()
            await server.stop(None)

    assert run(go()) == DrafterStats(True, 2, 40, 500, 40_000, 1, 7, 3)


class BrokenStats(BlockingDrafter):
    def stats(self):
        raise RuntimeError("boom")


def test_a_drafter_whose_stats_fail_reports_zeros():
    stats = DrafterSessions(BrokenStats()).stats()
    assert stats == {"has_cache": True, **dict.fromkeys(DRAFTER_STATS, 0)}


def test_a_dead_worker_raises_drafter_unavailable():
    async def go():
        server, port = await start_drafter_server(PromptLookupSpeculator(2, 4))
        await server.stop(None)
        async with DrafterClient(f"127.0.0.1:{port}", timeout_s=2) as client:
            await client.drafter_stats()

    with pytest.raises(DrafterUnavailable, match="Stats failed"):
        run(go())
