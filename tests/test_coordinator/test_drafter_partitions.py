"""The suffix drafter's cross-request cache through the scheduler, partitioned: a request in
another partition (tenant, ``cache_salt``) than an earlier identical one decodes with exactly
a fresh scheduler's counters, while one in the same partition gains from the earlier output;
every job names its request's partition; ``--suffix-cache-requests 0`` keeps nothing across
requests. Counters only, no timing (serial scheduling, no warm prefixes: the drafter's part
alone)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from drafters import plain_decode
from test_pipeline import FLAT

from coordinator.step.scheduler import Scheduler
from coordinator.step.targets import LocalTarget
from drafter_worker.local import LocalDrafter
from drafter_worker.registry import build_drafter
from drafter_worker.suffix import SuffixDrafter
from specd_core.request import SpeculativeOptions
from target_worker.engine import TargetEngine
from target_worker.loader import load_model

MODEL = "tiny-random:vocab=64,seed=0,layers=2"
PROMPT = [11, 3, 40, 22, 17, 9, 31, 5, 60, 2]
MAX_NEW = 40


class RecordingLocal(LocalDrafter):
    """A `LocalDrafter` that keeps every job's partition and every remembered partition."""

    def __init__(self, drafter):
        super().__init__(drafter)
        self.job_partitions: list[tuple[str, str]] = []
        self.remembered: list[str] = []

    async def propose(self, jobs):
        self.job_partitions.extend((j.request_id, j.partition) for j in jobs)
        return await super().propose(jobs)

    async def remember(self, outputs, partitions=None):
        self.remembered.extend(partitions or [""] * len(outputs))
        await super().remember(outputs, partitions)


def counters(result) -> tuple[int, int, int]:
    return result.forward_calls, result.drafted_tokens, result.accepted_tokens


def decode_in_turn(decoder, local, partitions, prompt=PROMPT):
    """``prompt`` once per entry of ``partitions``, one request after another through one
    serial scheduler over ``local`` (each output remembered before the next starts);
    returns the results and the requests."""

    async def go():
        sched = Scheduler(LocalTarget(TargetEngine(decoder, max_slots=1)), local,
                          max_active=1, adaptive=False, cost_model=FLAT, pipeline=False,
                          hidden_dtype=torch.float32, prefix_caching=False)
        sched.remember_outputs = local.capabilities.remembers
        results, reqs = [], []
        for partition in partitions:
            req = sched.submit(prompt, SpeculativeOptions(max_new_tokens=MAX_NEW))
            req.partition = partition
            await sched.run_until_idle()
            await sched.settle_drafter()
            results.append(req.decode.result)
            reqs.append(req)
        return results, reqs

    return asyncio.run(go())


def fresh(decoder, partition: str = "b"):
    """``PROMPT``'s result on a fresh scheduler and drafter."""
    return decode_in_turn(decoder, LocalDrafter(SuffixDrafter(max_draft_len=8)), [partition]
                          )[0][0]


def test_another_partition_decodes_as_on_a_fresh_scheduler_and_the_same_one_gains():
    decoder = load_model(MODEL)[0]
    local = RecordingLocal(SuffixDrafter(max_draft_len=8))
    (a1, b, a2, shared), reqs = decode_in_turn(decoder, local, ["a", "b", "a", ""])
    plain = plain_decode(decoder, PROMPT, MAX_NEW)
    assert all(r.generated_tokens == plain for r in (a1, b, a2, shared))  # lossless
    base = counters(fresh(decoder))
    assert counters(a1) == base  # nothing remembered yet
    # "b" after "a": exactly a fresh scheduler's forward calls, drafted and accepted tokens.
    assert counters(b) == base
    assert counters(shared) == counters(fresh(decoder, ""))
    # "a" again drafts its first answer from the cache: fewer forward calls.
    assert a2.forward_calls < a1.forward_calls and a2.accepted_tokens > a1.accepted_tokens
    # Every job named its request's partition, and every output went to its own.
    names = {req.id: req.partition for req in reqs}
    assert local.job_partitions and all(p == names[rid] for rid, p in local.job_partitions)
    assert local.remembered == ["a", "b", "a", ""]
    assert local.sessions.drafter.stats()["cache"]["partitions"] == 3


def test_cache_requests_0_keeps_nothing_across_requests_through_the_scheduler():
    decoder = load_model(MODEL)[0]
    drafter = build_drafter("suffix", max_draft_len=8, suffix_cache_requests=0)
    local = RecordingLocal(drafter)
    results, _ = decode_in_turn(decoder, local, ["a", "a", ""])
    base = counters(fresh(decoder))
    # The repeated request decodes exactly as on a fresh drafter (that keeps a cache but
    # has seen nothing): nothing was kept; and it still drafts from its own context.
    assert [counters(r) for r in results] == [base] * 3
    assert results[0].accepted_tokens > 0
    assert local.remembered == [] and len(drafter.cache) == 0  # nothing was even sent


@pytest.mark.parametrize("partition", ["", "tenant-x"])
def test_a_request_defaults_to_the_shared_partition_and_keeps_what_it_is_given(partition):
    decoder = load_model(MODEL)[0]
    local = RecordingLocal(SuffixDrafter(max_draft_len=8))

    async def go():
        sched = Scheduler(LocalTarget(TargetEngine(decoder, max_slots=1)), local,
                          max_active=1, adaptive=False, cost_model=FLAT, pipeline=True,
                          hidden_dtype=torch.float32)
        sched.remember_outputs = True
        req = sched.submit(PROMPT, SpeculativeOptions(max_new_tokens=12))
        assert req.partition == ""
        req.partition = partition
        await sched.run_until_idle()
        await sched.settle_drafter()
        return req

    req = asyncio.run(go())
    # Run-ahead jobs (pipelined) carry it too.
    assert local.job_partitions and {p for _, p in local.job_partitions} == {partition}
    assert local.remembered == [partition] and req.decode.finished


def test_the_service_config_accepts_0_and_refuses_a_negative_cache_size():
    from coordinator.cluster.config import ServiceConfig

    assert ServiceConfig(drafter="suffix", suffix_cache_requests=0).suffix_cache_requests == 0
    with pytest.raises(ValueError, match="suffix_cache_requests must be an int >= 0"):
        ServiceConfig(drafter="suffix+lookup", suffix_cache_requests=-1)
