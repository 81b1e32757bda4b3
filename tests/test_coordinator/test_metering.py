"""`MeteredTarget` counts each step's bytes from its structure: it never serialises a step
(the replica's transport already does once)."""

from __future__ import annotations

import asyncio
import pickle

import torch

from coordinator.cluster.replica import MeteredTarget
from specd_core.rule import GreedyRows
from specd_core.sampling import SamplingParams
from specd_core.step import StepOutput, VerifyItem, payload_bytes


class _Target:
    async def verify(self, items):
        return [StepOutput(GreedyRows(tuple(item.tokens)), torch.zeros(len(item.tokens), 8))
                for item in items]


def test_verify_bytes_are_counted_without_pickling_the_step(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the step was pickled to meter it")

    monkeypatch.setattr(pickle, "dumps", refuse)
    metered = MeteredTarget(_Target())
    items = [VerifyItem(0, 10, [1, 2, 3], SamplingParams()),
             VerifyItem(1, 20, [4, 5], SamplingParams())]
    out = asyncio.run(metered.verify(items))
    assert metered.stats["verify_calls"] == 1
    assert metered.stats["verify_bytes_sent"] == payload_bytes(items) > 0
    assert metered.stats["verify_bytes_received"] == payload_bytes(out) >= 5 * 8 * 4
