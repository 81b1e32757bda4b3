"""Hidden layers through Ray target replicas, as the service runs them: the production `Router`
over tensor-parallel (TP=2) replicas made by `create_target_replica` and driven over their step
channel (`ChannelTarget`: the items' ``hidden_layers`` cross the step codec to rank 0 and on to
rank 1), a drafter worker over gRPC (float16). Every committed position's rows equal a plain
forward's captured rows; a replica killed and re-created by the supervisor, and a drafter
worker added, keep it so (the setting travels with each step: nothing to restore)."""

from __future__ import annotations

import asyncio
import os
import secrets
import time

import pytest
from drafters import LayeredRecorder, plain_decode
from test_hidden_layers import F32, LAYERS, MODEL, PROMPTS, assert_rows_are_captured, fresh_decoder

from coordinator.cluster.router import Router
from drafter_worker.client import DrafterClient
from drafter_worker.server import start_drafter_server
from specd_core.request import SpeculativeDecodeResult, SpeculativeOptions
from target_worker.channel import ChannelTarget
from target_worker.tp import create_target_replica, destroy_target_replica

pytestmark = pytest.mark.slow  # Ray, two rank processes per replica, and a re-creation


@pytest.fixture(scope="module")
def ray_local():
    import ray

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    # Its own Ray: never one a `ray start` head (its ray_current_cluster file) points to.
    ray.init(address="local", include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    yield ray
    ray.shutdown()


async def until(condition, what: str, timeout_s: float = 120.0) -> None:
    """Waits on the event loop until ``condition()`` holds, failing after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} not reached within {timeout_s} s")
        await asyncio.sleep(0.05)


async def generate(router: Router, prompt: list[int], max_new: int) -> list[int]:
    req = router.submit(prompt, SpeculativeOptions(max_new_tokens=max_new))
    tokens = []
    while True:
        event = await req.events.get()
        if isinstance(event, list):
            tokens.extend(event)
        elif isinstance(event, SpeculativeDecodeResult):
            return tokens
        else:
            raise event


def test_tp2_ray_replicas_capture_the_layers_also_after_a_kill_and_a_scale_up(ray_local):
    ray = ray_local
    drafter = LayeredRecorder(LAYERS)
    handles: list = []
    servers: list = []

    async def start_replica(name: str):
        # The service's replica path (`CoordinatorActor._start_replica`, without TLS).
        loop = asyncio.get_running_loop()
        handle = await loop.run_in_executor(None, lambda: create_target_replica(
            MODEL, tp=2, max_slots=8, num_threads=1, dtype=F32, prefix_cache_tokens=0))
        info = dict(await handle.model_info.remote())
        secret = secrets.token_urlsafe(16)
        address = await handle.open_channel.remote("127.0.0.1", secret)
        handles.append(handle)

        async def stop() -> None:
            await loop.run_in_executor(None, destroy_target_replica, handle)

        return ChannelTarget(address, secret, handle), stop, info

    async def start_drafter(name: str):
        server, port = await start_drafter_server(drafter)
        servers.append(server)

        async def stop() -> None:
            await server.stop(None)

        return DrafterClient(f"127.0.0.1:{port}", timeout_s=10.0, hidden_dtype="float16"), stop

    async def main():
        router = Router(start_replica, start_drafter, max_active=4, adaptive=False,
                        restart_delay_s=0.2, probe_interval_s=1.0, target_timeout_s=60.0)
        try:
            await router.scale(target_replicas=1, drafters=1)
            assert router.hidden_layers == LAYERS
            outs = await asyncio.gather(*(generate(router, p, 24) for p in PROMPTS[:2]))
            first = len(drafter.sessions)
            # Kill the replica's rank 0 (rank 1 dies with it): the supervisor re-creates it.
            ray.kill(handles[0])
            replica = router.replicas["replica-0"]
            await until(lambda: replica.restarts == 1 and replica.state == "serving",
                        "the killed replica re-created and serving")
            after_kill = await generate(router, PROMPTS[2], 24)
            assert len(drafter.sessions) > first  # drafted on the new replica's rows
            await router.scale(drafters=2)
            scaled = await asyncio.gather(*(generate(router, p, 24) for p in PROMPTS))
            # New requests spread over both workers: the added one drafted too.
            assert all(m.client.stats["calls"] > 0 for m in router.pool.members.values())
            return outs, after_kill, scaled
        finally:
            await router.close()
            for handle in handles:
                destroy_target_replica(handle)

    outs, after_kill, scaled = asyncio.run(main())
    reference = fresh_decoder()
    for prompt, tokens in zip(PROMPTS[:2], outs, strict=True):
        assert tokens == plain_decode(reference, prompt, 24)
    assert after_kill == plain_decode(reference, PROMPTS[2], 24)
    for prompt, tokens in zip(PROMPTS, scaled, strict=True):
        assert tokens == plain_decode(reference, prompt, 24)
    assert len(handles) == 2 and len(servers) == 2  # a re-created replica, an added worker
    assert all(s.rows is not None for s in drafter.sessions)
    assert assert_rows_are_captured(drafter.sessions, LAYERS, float16=True) > 100
