"""The replica's step channel: calls reach the engine and come back (exceptions as raised),
only a client holding the secret is served, and a closed replica reads as dead."""

from __future__ import annotations

import asyncio
import socket

import pytest

from coordinator.router import is_replica_death
from specd_core.sampling import SamplingParams
from target_worker import load_model
from target_worker.actor import TargetActor
from target_worker.channel import ChannelClosed, ChannelServer, ChannelTarget, _frame
from target_worker.engine import PrefillItem, SlotsExhausted, TargetEngine, VerifyItem

MODEL = "tiny-random:vocab=64,seed=0,layers=2"


@pytest.fixture(scope="module")
def actor():
    return TargetActor(MODEL, max_slots=1, num_threads=1)


def test_steps_over_the_channel_equal_the_engines_own(actor):
    address = actor.open_channel("127.0.0.1", "s3cret")
    assert actor.open_channel("127.0.0.1", "s3cret") == address  # idempotent
    reference = TargetEngine(load_model(MODEL)[0], max_slots=1)

    async def steps(target):
        slot = await target.allocate()
        first = await target.prefill([PrefillItem(slot=slot, tokens=[5, 6, 7, 8],
                                                  sampling=SamplingParams())])
        out = await target.verify([VerifyItem(slot=slot, start_pos=4, tokens=[9, 5, 6],
                                              sampling=SamplingParams())])
        with pytest.raises(SlotsExhausted):  # the engine's own exception type comes back
            await target.allocate()
        with pytest.raises(ValueError, match="slot"):  # so does a refused item
            await target.verify([VerifyItem(slot=slot + 7, start_pos=0, tokens=[1],
                                            sampling=SamplingParams())])
        await target.free(slot)
        return first[0].rows.argmax, out[0].rows.argmax

    from coordinator.scheduler import LocalTarget

    async def both():
        channel = ChannelTarget(address, "s3cret")
        try:
            return await steps(channel), await steps(LocalTarget(reference))
        finally:
            await channel.close()

    over_channel, local = asyncio.run(both())
    assert over_channel == local


def test_a_client_without_the_secret_is_closed_unread():
    calls = []
    server = ChannelServer(lambda m, a: calls.append(m), ["allocate"], "right")
    try:
        async def go(secret):
            target = ChannelTarget(f"127.0.0.1:{server.port}", secret)
            try:
                return await target.allocate()
            finally:
                await target.close()

        with pytest.raises(ChannelClosed) as info:
            asyncio.run(go("wrong"))
        assert is_replica_death(info.value)
        assert calls == []
        assert asyncio.run(go("right")) is None and calls == ["allocate"]
        # Raw bytes before the secret are never unpickled either.
        with socket.create_connection(("127.0.0.1", server.port)) as raw:
            raw.sendall(_frame(b"\x80\x05not-the-secret"))
            assert raw.recv(16) == b""
        assert calls == ["allocate"]
    finally:
        server.close()


def test_an_unknown_method_is_refused_and_a_closed_replica_reads_as_dead():
    server = ChannelServer(lambda m, a: m, ["allocate"], "k")

    async def go():
        target = ChannelTarget(f"127.0.0.1:{server.port}", "k")
        with pytest.raises(ValueError, match="unknown target method 'shutdown'"):
            await target.call("shutdown")
        assert await target.allocate() == "allocate"
        server.close()
        await target.close()
        with pytest.raises(ChannelClosed):
            await target.allocate()

    asyncio.run(go())
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]

    async def refused():
        await ChannelTarget(f"127.0.0.1:{free}", "k").allocate()

    with pytest.raises(ChannelClosed) as info:
        asyncio.run(refused())
    assert is_replica_death(info.value)
