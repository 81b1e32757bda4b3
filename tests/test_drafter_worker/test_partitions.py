"""The suffix drafter's cross-request cache, partitioned (tenant and ``cache_salt``): a
partition's outputs draft for it and never for another, the per-partition and total bounds
hold over many partitions (least recently used partition's oldest output first), ``0`` keeps
nothing across requests while a request still drafts from its own context, and the partition
travels over the real gRPC drafter server (Propose items and remembered outputs)."""

from __future__ import annotations

import asyncio
import random
from collections import OrderedDict, deque

import grpc
import pytest
from test_suffix import brute_counts

from drafter_worker.client import DrafterClient, DrafterStats, ProposeJob
from drafter_worker.local import LocalDrafter
from drafter_worker.registry import build_drafter, check_drafter
from drafter_worker.server import start_drafter_server
from drafter_worker.sessions import MAX_PARTITION_CHARS, DrafterSessions
from drafter_worker.suffix import PartitionedCache, SuffixDrafter
from specd.v1 import drafter_pb2, drafter_pb2_grpc
from specd_core.draft import drafter_capabilities, propose_ahead

# Guards against a hung RPC stalling the suite; never reached by a passing test.
_SAFETY_S = 60

#: An earlier answer of distinct tokens: a request that starts like it has no match in its
#: own context, so only the cache (previous outputs) can draft its continuation.
ANSWER = list(range(50, 70))
#: A request whose history starts like ``ANSWER``.
ASKS = ANSWER[:6]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, _SAFETY_S))


def drafts(drafter: SuffixDrafter, partition: str, history, steps: int = 12) -> list:
    """The blocks one request of ``partition`` is proposed while its history grows by the
    block drafted (or one token past the end of ``ANSWER`` when none), plain and run-ahead."""
    session = drafter.session(partition=partition)
    history, out = list(history), []
    for _ in range(steps):
        block = session.propose(history, None, 6)
        ahead = propose_ahead(session, history, None, [history[-1]], 6)
        out.append((block.tokens, ahead.tokens))
        history += list(block.tokens) or [history[-1] + 1]
    return out


# ---- the drafter ----


def test_a_partitions_outputs_draft_for_it_and_never_for_another():
    rng = random.Random(3)
    others = [[rng.randrange(40) for _ in range(30)] for _ in range(4)]
    drafter = SuffixDrafter(max_draft_len=6)
    drafter.remember([ANSWER], ["tenant-a"])
    drafter.remember(others, ["tenant-c"] * len(others))
    # Partition a drafts the remembered answer's continuation from the first proposal on.
    first, _ = drafts(drafter, "tenant-a", ASKS, 1)[0]
    assert first == tuple(ANSWER[6:12])
    # Another partition, and the shared one, draft exactly what a drafter that never saw
    # the answer drafts: the same blocks, run-ahead included, step after step.
    for partition in ("tenant-b", "", "tenant-a "):
        fresh = SuffixDrafter(max_draft_len=6)
        fresh.remember(others, ["tenant-c"] * len(others))
        for history in (ASKS, others[0][:8], [*ASKS, *others[1][:5]]):
            assert drafts(drafter, partition, history) == drafts(fresh, partition, history)
    assert drafts(drafter, "tenant-b", ASKS)[0][0] == ()
    # A drafter session without a partition, and `propose` without a session: the shared one.
    assert drafter.propose(ASKS, None, 6).tokens == ()
    drafter.remember([ANSWER])
    assert drafter.propose(ASKS, None, 6).tokens == tuple(ANSWER[6:12])
    stats = drafter.stats()["cache"]
    assert (stats["partitions"], stats["outputs"]) == (3, 2 + len(others))


def test_remember_needs_one_partition_per_output():
    drafter = SuffixDrafter()
    with pytest.raises(ValueError, match="2 partitions for 1 outputs"):
        drafter.remember([ANSWER], ["a", "b"])
    assert len(drafter.cache) == 0


def model_lru(events, total: int, per: int) -> OrderedDict:
    """The policy the cache documents, with no node budget: each partition FIFO within
    ``per``; past ``total`` outputs the least recently used partition (use: an add or a
    draft lookup) loses its oldest; a partition left empty goes."""
    parts: OrderedDict[str, deque] = OrderedDict()
    for kind, name, output in events:
        if kind == "look":
            if name in parts:
                parts.move_to_end(name)
            continue
        q = parts.setdefault(name, deque())
        parts.move_to_end(name)
        q.append(tuple(output))
        if len(q) > per:
            q.popleft()
        while sum(map(len, parts.values())) > total:
            victim = next(iter(parts))
            parts[victim].popleft()
            if not parts[victim]:
                del parts[victim]
    return parts


def test_the_total_and_per_partition_bounds_hold_across_many_partitions():
    rng = random.Random(11)
    depth, total, per = 6, 25, 4
    cache = PartitionedCache(max_requests=total, max_nodes=10**6, depth=depth,
                             partition_requests=per)
    events = []
    for i in range(400):
        name = f"p{rng.randrange(40)}"
        if rng.random() < 0.3:
            events.append(("look", name, None))
            cache.speculate(name, [1, 2, 3], 4, 2.0, 0.5)
        else:
            out = [rng.randrange(30) for _ in range(rng.randint(1, 12))]
            events.append(("add", name, out))
            cache.add(out, name)
        expected = model_lru(events, total, per)
        assert len(cache) == sum(map(len, expected.values())) <= total
        stats = cache.stats()
        assert stats["partitions"] == len(expected)
        if i % 40 == 0 or i == 399:  # every partition holds exactly the model's outputs
            for name, kept in expected.items():
                assert cache.partition(name).tree.dump() == dict(brute_counts(kept, depth))
            held = [o for kept in expected.values() for o in kept]
            assert stats["tokens"] == sum(map(len, held))
            assert stats["nodes"] == sum(len(cache.partition(n).tree.dump()) for n in expected)
    assert stats["evicted"] == sum(1 for e in events if e[0] == "add") - len(cache)


def test_the_total_node_budget_holds_across_many_partitions():
    rng = random.Random(12)
    budget, depth = 400, 6
    cache = PartitionedCache(max_requests=10_000, max_nodes=budget, depth=depth)
    for _ in range(300):
        cache.add([rng.randrange(50) for _ in range(rng.randint(1, 40))],
                  f"t{rng.randrange(60)}")
        s = cache.stats()
        assert s["nodes"] <= budget and s["outputs"] >= 1
        assert s["partitions"] <= s["outputs"]  # an empty partition is never kept
    # One output longer than the budget allows is cut, so it alone still fits.
    cache.add(list(range(10_000)), "long")
    assert cache.stats()["nodes"] <= budget and cache.partition("long") is not None


def test_the_least_recently_used_partition_loses_its_oldest_output_first():
    cache = PartitionedCache(max_requests=3, depth=4)
    cache.add([1, 2], "old")
    cache.add([3, 4], "used")
    cache.add([5, 6], "old")
    cache.speculate("used", [9], 2, 2.0, 0.5)  # a draft lookup makes "used" recent
    cache.add([7, 8], "new")
    # "old" (least recently used) lost its oldest output, kept its newest.
    assert cache.partition("old").tree.count([1, 2]) == 0
    assert cache.partition("old").tree.count([5, 6]) == 1
    assert cache.partition("used").tree.count([3, 4]) == 1
    cache.add([9, 10], "new")
    assert cache.partition("old") is None  # emptied, so dropped
    assert cache.stats()["partitions"] == 2 and len(cache) == 3


@pytest.mark.parametrize("bad", [{"max_requests": -1}, {"max_nodes": 0},
                                 {"partition_requests": 0}, {"partition_nodes": 0},
                                 {"depth": 1}, {"max_requests": True}])
def test_bad_partitioned_cache_bounds_are_refused(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        PartitionedCache(**bad)


# ---- --suffix-cache-requests 0 ----


def test_cache_requests_0_keeps_nothing_across_requests_but_drafts_within_one():
    drafter = build_drafter("suffix", max_draft_len=6, suffix_cache_requests=0)
    assert not drafter_capabilities(drafter).remembers
    sessions = DrafterSessions(drafter)
    assert sessions.remember([ANSWER], ["a"]) == 0  # not a drafter that remembers
    drafter.remember([ANSWER, ANSWER], ["a", ""])  # even handed directly: ignored
    assert len(drafter.cache) == 0 and drafter.stats()["cache"]["partitions"] == 0
    # A repeated request drafts exactly as on a fresh drafter ...
    fresh = build_drafter("suffix", max_draft_len=6, suffix_cache_requests=0)
    for partition in ("a", ""):
        assert drafts(drafter, partition, ASKS) == drafts(fresh, partition, ASKS)
    # ... while its own context still drafts: a repeated phrase is continued.
    own = [*ANSWER[:10], 7, *ANSWER[:4]]
    assert drafter.session(partition="a").propose(own, None, 6).tokens == tuple(ANSWER[4:10])
    assert sessions.stats()["has_cache"] is False


def test_the_cache_size_flag_accepts_0_and_refuses_negatives_clearly():
    for name in ("suffix", "suffix+lookup"):
        check_drafter(name, suffix_cache_requests=0)
        for bad in (-1, 1.5, True):
            with pytest.raises(ValueError, match="suffix_cache_requests must be an int >= 0"):
                check_drafter(name, suffix_cache_requests=bad)
        with pytest.raises(ValueError, match="suffix_cache_requests must be an int >= 0"):
            build_drafter(name, suffix_cache_requests=-3)
    with pytest.raises(ValueError, match="suffix"):
        check_drafter("prompt-lookup", suffix_cache_requests=0)


# ---- sessions: the partition of an id ----


def test_an_id_held_for_another_partition_resyncs_instead_of_drafting_from_it():
    drafter = SuffixDrafter(max_draft_len=6)
    drafter.remember([ANSWER], ["a"])
    sessions = DrafterSessions(drafter)
    resync, block = sessions.propose("r", 0, ASKS, 6, partition="a")
    assert not resync and block.tokens == tuple(ANSWER[6:12])
    # The same id, its history continued, now named for "b": dropped, resync asked.
    resync, block = sessions.propose("r", len(ASKS), [ANSWER[6]], 6, partition="b")
    assert resync and len(block) == 0 and sessions.history("r") is None
    # The resend (known = 0) makes a fresh session for "b", which has nothing remembered.
    resync, block = sessions.propose("r", 0, [*ASKS, ANSWER[6]], 6, partition="b")
    assert not resync and block.tokens == ()


def test_a_too_long_partition_is_refused_before_anything_is_sent():
    local = LocalDrafter(SuffixDrafter())
    job = ProposeJob("r", ASKS, 4, partition="x" * (MAX_PARTITION_CHARS + 1))
    with pytest.raises(ValueError, match="partition must be a str of at most"):
        run(local.propose([job]))
    assert local.sessions.history("r") is None
    sessions = DrafterSessions(SuffixDrafter())
    assert sessions.remember([ANSWER, ANSWER], ["x" * (MAX_PARTITION_CHARS + 1), "ok"]) == 1
    assert sessions.stats()["cache_partitions"] == 1


# ---- over the real gRPC drafter server ----


def test_the_partition_travels_over_the_grpc_drafter_server():
    drafter = SuffixDrafter(max_draft_len=6)

    async def go():
        server, port = await start_drafter_server(drafter)
        address = f"127.0.0.1:{port}"
        try:
            async with DrafterClient(address, timeout_s=10) as client:
                await client.remember([ANSWER, ANSWER[::-1]], ["a", "b"])
                got = {p: (await client.propose([ProposeJob(f"r-{p}", ASKS, 6, partition=p)]))[0]
                       for p in ("a", "b", "c", "")}
                # Later items of an id carry the partition too: its deltas draft from "a".
                history = [*ASKS, *got["a"].tokens]
                later, = await client.propose([ProposeJob("r-a", history, 6, partition="a")])
                assert client.known("r-a") == len(history)
                stats = await client.drafter_stats()
                # The raw wire: a too-long partition is refused as a whole call.
                async with grpc.aio.insecure_channel(address) as channel:
                    stub = drafter_pb2_grpc.DrafterStub(channel)
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await stub.Propose(drafter_pb2.ProposeRequest(items=[
                            drafter_pb2.ProposeItem(request_id="z", append=ASKS, max_len=4,
                                                    partition="p" * 300)]))
                return got, later, stats, refused.value
        finally:
            await server.stop(None)

    got, later, stats, refused = run(go())
    assert got["a"].tokens == tuple(ANSWER[6:12])
    assert got["b"].tokens == got["c"].tokens == got[""].tokens == ()
    assert later.tokens == tuple(ANSWER[12:18])
    assert drafter.cache.partition("a").tree.count(ANSWER[:3]) == 1
    assert drafter.cache.partition("b").tree.count(ANSWER[:3]) == 0
    assert drafter.cache.partition("") is None and drafter.cache.partition("c") is None
    assert stats == DrafterStats(
        has_cache=True, cache_outputs=2, cache_tokens=2 * len(ANSWER),
        cache_nodes=drafter.cache.nodes, cache_bytes=drafter.cache.stats()["approx_bytes"],
        proposals=5, global_hits=2, cache_partitions=2)
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "items[0].partition" in refused.details()
