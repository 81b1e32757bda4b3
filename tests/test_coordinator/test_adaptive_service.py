"""Adaptive draft length inside the service's Scheduler: the choice (0 included) only changes
how many drafts are verified, never a greedy or seeded output; the cost is measured through
the Target interface."""

from __future__ import annotations

import asyncio

import pytest
from service_harness import LocalService, run_in_thread
from test_service import MIXED, solo, stream_tokens

from coordinator.step.adaptive import ForwardCostModel, calibrate_target
from coordinator.step.targets import LocalTarget
from target_worker.engine import TargetEngine
from target_worker.loader import load_model

#: Drafting never pays, at any batch size: each token more in a step costs ten times the step
#: (frozen). Given to 128 tokens, past any step here: beyond its points a model extends
#: linearly, and under a linear tail cost(b + 1) / cost(b) nears 1 in a batch of b tokens, so
#: a draft's 1 + a expected tokens would pay there (the old two-point curve did, by timing).
STEEP = ForwardCostModel({n: 10.0 ** (n - 1) for n in range(1, 129)}, alpha=0.0)
#: Drafting is free (frozen).
FLAT = ForwardCostModel({1: 1.0}, alpha=0.0)


def _run_all(service) -> list[tuple[list[int], object]]:
    futures = [run_in_thread(stream_tokens, service, r) for r in MIXED]
    return [f.result(timeout=180) for f in futures]


@pytest.mark.parametrize("cost", [STEEP, FLAT, None], ids=["steep", "flat", "calibrated"])
def test_adaptive_scheduler_outputs_equal_the_fixed_length_solo_runs(cost):
    service = LocalService(adaptive=True, cost_model=cost).start()
    try:
        # Solo runs: in-process, no adaptive policy, the drafter's full budget every step.
        expected = [solo(service, r) for r in MIXED]
        results = _run_all(service)
        for i, (tokens, _) in enumerate(results):
            assert tokens == expected[i], f"request {i} (seeded={MIXED[i].HasField('seed')})"
        drafted = sum(final.speculation.drafted_tokens for _, final in results)
        if cost is STEEP:
            assert drafted == 0  # k = 0 every step: the drafter was never asked
            assert all(final.speculation.forward_calls == len(tokens)
                       for tokens, final in results)
        elif cost is FLAT:
            assert drafted > 0
        if cost is None:  # measured through the target before the first admission
            (replica,) = service.scheduler.replicas.values()
            assert replica.scheduler.cost_model is not None
            assert {1, 2, 4, 8} <= set(replica.scheduler.cost_model.points())
    finally:
        service.stop()


def test_fixed_and_adaptive_services_agree_and_fixed_drafts_more():
    fixed = LocalService(adaptive=False).start()
    try:
        off = _run_all(fixed)
    finally:
        fixed.stop()
    adaptive = LocalService(adaptive=True, cost_model=STEEP).start()
    try:
        on = _run_all(adaptive)
    finally:
        adaptive.stop()
    assert [t for t, _ in on] == [t for t, _ in off]
    assert sum(f.speculation.drafted_tokens for _, f in off) > 0
    assert sum(f.speculation.drafted_tokens for _, f in on) == 0


def test_calibrate_target_measures_each_size_and_frees_its_slot():
    decoder, _ = load_model("tiny-random:vocab=64,seed=0,layers=1")
    engine = TargetEngine(decoder, max_slots=2)
    model = asyncio.run(calibrate_target(LocalTarget(engine), cache_len=32, sizes=(1, 4, 16),
                                         repeats=1))
    assert sorted(model.points()) == [1, 4, 16]
    assert all(s > 0 for s in model.points().values())
    assert engine.used_slots == 0
    # A size past the 256-token context ends the calibration with what was measured.
    model = asyncio.run(calibrate_target(LocalTarget(engine), cache_len=240, sizes=(1, 8, 32),
                                         repeats=1))
    assert sorted(model.points()) == [1, 8]
    assert engine.used_slots == 0
