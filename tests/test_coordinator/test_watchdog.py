"""Replica supervision that does not wait for one fixed timeout: a stalled replica is found
within a deadline scaled by its measured step cost (`coordinator.cluster.failures.StallWatchdog`),
far below ``target_timeout_s``; and an idle replica whose process dies is found the moment its
step channel closes (`ChannelTarget.watch`), out of placement and restarting before any
request is sent to it."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
from service_harness import MODEL, LocalService
from test_service import REPEATING, request, stream_tokens
from test_supervision import (
    assert_unavailable_without_internals,
    death,
    dying_replica,
    replica_states,
    wait_until,
)

from coordinator.cluster.failures import StallWatchdog
from coordinator.cluster.replica import MeteredTarget
from coordinator.step.errors import ReplicaFailed
from specd_core.sampling import SamplingParams
from specd_core.step import VerifyItem
from target_worker.channel import ChannelTarget


def test_the_deadline_scales_with_the_measured_cost_between_a_floor_and_the_cap():
    dog = StallWatchdog(cap_s=600.0, factor=10.0, floor_s=1.0)
    assert dog.deadline_s(8) == 600.0  # nothing measured yet: the cap
    for _ in range(20):
        dog.observe(8, 0.05)  # decode steps: 50 ms for 8 tokens
    assert dog.predicted_s(8) == pytest.approx(0.05)
    assert dog.deadline_s(8) == 1.0  # 10 x 50 ms is under the floor
    assert dog.deadline_s(0) == 1.0  # allocate / free
    # A 2048-token prefill is predicted from the per-token cost: 12.8 s, deadline 128 s.
    assert dog.predicted_s(2048) == pytest.approx(0.05 / 8 * 2048)
    assert dog.deadline_s(2048) == pytest.approx(128.0)
    assert dog.deadline_s(100_000) == 600.0  # never past the cap
    for bad in ({"cap_s": 0}, {"cap_s": 1, "factor": 1.0}, {"cap_s": 1, "floor_s": -1}):
        with pytest.raises(ValueError):
            StallWatchdog(**bad)


class _Stalling:
    """Verify calls answer after ``delay_s`` until ``stall`` is set; then they never do."""

    def __init__(self, delay_s: float):
        self.delay_s = delay_s
        self.stall = False

    async def verify(self, items):
        if self.stall:
            await asyncio.Event().wait()
        await asyncio.sleep(self.delay_s)
        return [None] * len(items)


def test_a_stalled_call_fails_within_its_scaled_deadline_not_the_cap():
    async def scenario():
        inner = _Stalling(0.01)
        metered = MeteredTarget(inner, timeout_s=600.0, stall_factor=10.0, stall_floor_s=0.2)
        items = [VerifyItem(0, 0, [1, 2, 3], SamplingParams())]
        for _ in range(5):
            await metered.verify(items)  # ~10 ms each: the deadline becomes the 0.2 s floor
        assert metered.watchdog.deadline_s(3) == pytest.approx(0.2)
        inner.stall = True
        began = time.monotonic()
        with pytest.raises(ReplicaFailed, match="did not answer within"):
            await metered.verify(items)
        return time.monotonic() - began, metered

    took, metered = asyncio.run(scenario())
    assert 0.2 <= took < 5.0  # the cap was 600 s
    assert metered.failed


def test_a_stalled_replica_fails_its_stream_fast_and_is_restarted():
    svc = LocalService(replicas=1, drafters=1, target_timeout_s=600.0).start()
    try:
        before, _ = stream_tokens(svc, request(REPEATING, max_new=20))
        metered = svc.router.replicas["replica-0"].target
        metered.watchdog.floor_s = 0.5  # the tiny model's steps take milliseconds
        # The floor, or 10x the measured step where a busy machine slows steps past 50 ms: a
        # deadline of seconds either way, not the 600 s cap.
        assert 0.5 <= metered.watchdog.deadline_s(8) < 5.0
        dying_replica(svc, hang=True)
        began = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            stream_tokens(svc, request(REPEATING, max_new=20))
        assert time.monotonic() - began < 10.0  # against the 600 s cap before
        assert_unavailable_without_internals(err.value)
        wait_until(lambda: replica_states(svc) == {"replica-0": "serving"}, what="restarted")
        assert svc.router.status()["replicas"][0]["restarts"] == 1
        assert stream_tokens(svc, request(REPEATING, max_new=20))[0] == before
    finally:
        svc.stop()


_REPLICA = """
import sys, time
from target_worker.actor import TargetActor
actor = TargetActor(sys.argv[1], max_slots=16, num_threads=1)
print(actor.open_channel("127.0.0.1", sys.argv[2]), flush=True)
time.sleep(3600)
"""


class ChannelService(LocalService):
    """`LocalService` whose replicas are processes serving the step channel (as a Ray
    replica does), reached through `ChannelTarget`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.processes: dict[str, subprocess.Popen] = {}

    async def _start_replica(self, name: str):
        proc = subprocess.Popen([sys.executable, "-c", _REPLICA, self.model, "s3cret"],
                                stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        address = (await asyncio.to_thread(proc.stdout.readline)).strip()
        assert address, "the replica process did not start"
        self.processes[name] = proc

        async def stop() -> None:
            if proc.poll() is None:
                proc.kill()
            await asyncio.to_thread(proc.wait)

        return ChannelTarget(address, "s3cret"), stop, {
            "vocab_size": self.decoder.config.vocab_size,
            "max_seq_len": self.decoder.config.max_seq_len}

    def stop(self) -> None:
        try:
            super().stop()
        finally:
            for proc in self.processes.values():
                if proc.poll() is None:
                    proc.kill()
                proc.wait()


def test_an_idle_replicas_death_is_found_before_a_request_is_sent_to_it():
    svc = ChannelService(replicas=1, drafters=1, model=MODEL).start()
    try:
        async def no_probe() -> None:  # the periodic probe must not be what finds it
            svc.router._probe_task.cancel()

        svc.call(no_probe())
        before, _ = stream_tokens(svc, request(REPEATING, max_new=20))
        first = svc.processes["replica-0"]
        first.send_signal(signal.SIGKILL)  # our own child process: the replica dies idle
        replica = svc.router.replicas["replica-0"]
        # Found from the closed channel, with no probe and no request: out of placement at
        # once (the kernel closes a dead process's sockets), not after a probe interval.
        wait_until(lambda: replica.state != "serving" or replica.restarts == 1, timeout_s=3,
                   what="the dead idle replica out of placement")
        wait_until(lambda: replica.restarts == 1 and replica.state == "serving", timeout_s=60,
                   what="the dead idle replica restarted")
        assert svc.processes["replica-0"] is not first
        assert replica_states(svc) == {"replica-0": "serving"}
        # The next request never meets the dead replica.
        assert stream_tokens(svc, request(REPEATING, max_new=20))[0] == before
        assert svc.router.status()["failed"] == 0
    finally:
        svc.stop()


class _Frozen:
    """A replica's target whose Ray status calls never answer (a SIGSTOP'd process)."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    @property
    def handle(self):
        class Handle:
            class status:
                @staticmethod
                def remote():
                    return asyncio.get_running_loop().create_future()  # never set
        return Handle()


def test_an_idle_frozen_replica_is_taken_out_before_a_request_waits_on_it():
    svc = LocalService(replicas=1, drafters=1, target_timeout_s=600.0).start()
    try:
        before, _ = stream_tokens(svc, request(REPEATING, max_new=20))
        replica = svc.router.replicas["replica-0"]
        replica.target.watchdog.floor_s = 0.3  # the tiny model's steps take milliseconds
        limit = replica.target.watchdog.deadline_s(0)
        assert limit == pytest.approx(0.3)
        frozen = replica.target
        frozen.inner = _Frozen(frozen.inner)
        began = time.monotonic()
        # Probes as the periodic loop sends them; silence shorter than a call's deadline is
        # tolerated, longer is a stall.
        svc.call(svc.router.probe(timeout_s=0.05))
        assert replica.state == "serving" and replica.silent_since is not None
        deadline = time.monotonic() + 10
        while replica.target is frozen and not frozen.failed and time.monotonic() < deadline:
            svc.call(svc.router.probe(timeout_s=0.05))
        assert frozen.failed and "stalled" in frozen.failure
        assert limit <= time.monotonic() - began < 10
        wait_until(lambda: replica.restarts == 1 and replica.state == "serving",
                   what="the frozen replica re-created")
        assert stream_tokens(svc, request(REPEATING, max_new=20))[0] == before
        assert svc.router.status()["failed"] == 0  # no request was ever sent to it
    finally:
        svc.stop()


class _DiesOnFree:
    """A replica's target whose process dies right after a request finished: the ``free``
    of its slot is the only call that meets the death."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def free(self, slot):
        raise death()


def test_a_death_only_a_free_met_takes_the_replica_out_before_the_next_request():
    svc = LocalService(replicas=1, drafters=1).start()
    try:
        before, _ = stream_tokens(svc, request(REPEATING, max_new=20))
        replica = svc.router.replicas["replica-0"]
        replica.target.inner = _DiesOnFree(replica.target.inner)
        assert stream_tokens(svc, request(REPEATING, max_new=20))[0] == before
        wait_until(lambda: replica.restarts == 1 and replica.state == "serving",
                   what="the replica re-created after its free failed")
        # Before, the next request met the failed replica and failed with UNAVAILABLE.
        assert stream_tokens(svc, request(REPEATING, max_new=20))[0] == before
        assert svc.router.status()["failed"] == 0
    finally:
        svc.stop()
