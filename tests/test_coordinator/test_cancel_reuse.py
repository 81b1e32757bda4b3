"""A cancelled stream's slot is free before admission reuses it: the request waiting for that
slot is served, never failed as if the target replica had died (a slot freed in a background
task raced the next allocation: every waiter of a full replica failed with UNAVAILABLE)."""

from __future__ import annotations

import asyncio

from coordinator.step.requests import ServiceRequest
from coordinator.step.scheduler import Scheduler
from coordinator.step.targets import LocalTarget
from specd_core.request import SpeculativeDecodeResult, SpeculativeOptions
from target_worker.engine import TargetEngine
from target_worker.loader import load_model

MODEL = "tiny-random:vocab=64,seed=0,layers=2"


class GatedTarget(LocalTarget):
    """Verify calls wait for ``gate``: the test decides when a step may finish."""

    def __init__(self, engine: TargetEngine):
        super().__init__(engine)
        self.gate = asyncio.Event()
        self.gate.set()

    async def verify(self, items: list) -> list:
        await self.gate.wait()
        return await super().verify(items)


async def outcome(req: ServiceRequest) -> list[int] | BaseException:
    """The request's tokens, or what ended it."""
    tokens: list[int] = []
    while True:
        event = await asyncio.wait_for(req.events.get(), timeout=60)
        if isinstance(event, list):
            tokens.extend(event)
        elif isinstance(event, SpeculativeDecodeResult):
            return tokens
        else:
            return event


def test_the_request_waiting_for_a_cancelled_streams_slot_is_served():
    decoder, _ = load_model(MODEL)
    options = SpeculativeOptions(max_new_tokens=8)

    async def run() -> tuple[list, list]:
        engine = TargetEngine(decoder, max_slots=1)
        target = GatedTarget(engine)
        scheduler = Scheduler(target, max_active=1, adaptive=False)
        scheduler.start()
        solo = await outcome(scheduler.submit([5, 6, 7], options))
        results = []
        for _ in range(3):
            target.gate.clear()  # the holder's first verify step cannot finish yet
            holder = scheduler.submit([1, 2, 3], SpeculativeOptions(max_new_tokens=200))
            assert isinstance(await asyncio.wait_for(holder.events.get(), 60), list)
            waiter = scheduler.submit([5, 6, 7], options)  # queued: the only slot is taken
            scheduler.cancel(holder)
            target.gate.set()  # that step ends; the next admission reuses the slot
            results.append(await outcome(waiter))
        await scheduler.close()
        assert engine.used_slots == 0
        return solo, results

    solo, results = asyncio.run(run())
    assert isinstance(solo, list) and len(solo) == 8
    assert results == [solo] * 3
