"""Workers that come back (`coordinator.cluster.router` supervision,
`coordinator.cluster.drafter_pool`), in process on the tiny random model: a target replica that dies
or hangs mid-stream fails its in-flight requests fast with UNAVAILABLE (no internals), moves the
ones it had not started, reports NOT_SERVING until it is re-created, and then serves the same tokens
as before; Scale removes a failed replica before a healthy one; a drafter whose worker is gone is
marked unhealthy, replaced, and drafting resumes with unchanged outputs."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import ray.exceptions
from grpc_health.v1 import health_pb2, health_pb2_grpc
from polling import wait_until
from service_harness import LocalService, run_in_thread
from test_scaling import PROMPTS, FakeClient, collect, gate_all, greedy_solo, options, until
from test_service import REPEATING, request, stream_tokens

from coordinator.cluster.drafter_pool import DrafterPool
from coordinator.front.grpc_api import GENERATION_SERVICE
from drafter_worker.client import ProposeJob
from specd.v1 import generation_pb2

#: What Ray's real error carries and a client must never see.
INTERNALS = ("4242", "10.9.8.7", "a1b2c3d4", "RayActorError", "Actor")


def death() -> Exception:
    return ray.exceptions.RayActorError(
        actor_id="a1b2c3d4", error_msg="The actor died unexpectedly: pid=4242, ip=10.9.8.7")


class Dying:
    """Wraps a replica's target. Once ``dead``, every call raises Ray's actor-death error;
    with ``hold`` a verify first waits (the stream stays mid-flight) until ``release``, then
    raises it (or, with ``hang``, never answers at all)."""

    def __init__(self, inner, hold: bool = True, hang: bool = False):
        self.inner = inner
        self.hold, self.hang = hold, hang
        self.dead = False
        self.reached = asyncio.Event()
        self.release = asyncio.Event()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def allocate(self):
        if self.dead:
            raise death()
        return await self.inner.allocate()

    async def prefill(self, items):
        if self.dead:
            raise death()
        return await self.inner.prefill(items)

    async def verify(self, items):
        if self.hold:
            self.reached.set()
            if self.hang:
                await asyncio.Event().wait()  # never set: only the deadline ends this
            await self.release.wait()
            self.dead = True
        if self.dead:
            raise death()
        return await self.inner.verify(items)

    @property
    def handle(self):
        """What the status probe calls: Ray's handle of a dead actor raises."""
        if not self.dead:
            raise AttributeError("handle")  # alive: the probe reads the local engine

        class Handle:
            class status:
                @staticmethod
                def remote():
                    raise death()
        return Handle()


class GatedFactory:
    """A replica or drafter factory whose calls (for the names in ``held``, default all) wait
    until ``open`` is set, so a test sees the service while a restart is pending; counts the
    held calls."""

    def __init__(self, inner, held: set[str] | None = None):
        self.inner = inner
        self.held = held
        self.open = asyncio.Event()
        self.calls = 0

    async def __call__(self, name):
        if self.held is None or name in self.held:
            self.calls += 1
            await self.open.wait()
        return await self.inner(name)


def on_loop(svc: LocalService, fn) -> None:
    svc.loop.call_soon_threadsafe(fn)


def health(svc: LocalService) -> tuple[int, int]:
    with grpc.insecure_channel(svc.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return tuple(stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=10).status
                     for name in ("", GENERATION_SERVICE))


SERVING = (health_pb2.HealthCheckResponse.SERVING,) * 2
NOT_SERVING = (health_pb2.HealthCheckResponse.NOT_SERVING,) * 2


def replica_states(svc: LocalService) -> dict[str, str]:
    channel, stub = svc.stub()
    with channel:
        status = stub.Status(generation_pb2.StatusRequest(), timeout=10)
    return {r.name: r.state for r in status.replicas}


def dying_replica(svc: LocalService, name: str = "replica-0", **kwargs) -> Dying:
    replica = svc.router.replicas[name]
    dying = Dying(replica.target.inner, **kwargs)
    replica.target.inner = dying
    return dying


def assert_unavailable_without_internals(err: grpc.RpcError) -> None:
    assert err.code() == grpc.StatusCode.UNAVAILABLE, (err.code(), err.details())
    for secret in INTERNALS:
        assert secret not in err.details(), err.details()


def test_target_that_dies_mid_stream_fails_fast_then_is_restarted_with_the_same_tokens():
    svc = LocalService(replicas=1, drafters=1, max_active=4).start()
    try:
        prompt = REPEATING
        before, _ = stream_tokens(svc, request(prompt, max_new=30))
        assert health(svc) == SERVING
        dying = dying_replica(svc)
        factory = svc.router.replica_factory = GatedFactory(svc.router.replica_factory)
        streams = [run_in_thread(stream_tokens, svc, request(p, max_new=30))
                   for p in (prompt, PROMPTS[1])]
        wait_until(dying.reached.is_set, what="a verify in flight")
        # Both placed before the death (a request sent after it is refused at once, never
        # counted as failed): the first run's request and these two.
        scheduler = svc.router.replicas["replica-0"].scheduler
        wait_until(lambda: scheduler.placed == 3, what="both streams placed")
        on_loop(svc, dying.release.set)  # the replica dies under both streams
        for f in streams:
            with pytest.raises(grpc.RpcError) as err:
                f.result(timeout=30)  # fails fast: the restart is still held back
            assert_unavailable_without_internals(err.value)
        wait_until(lambda: factory.calls == 1, what="the restart under way")
        wait_until(lambda: health(svc) == NOT_SERVING, what="health NOT_SERVING")
        assert replica_states(svc) == {"replica-0": "restarting"}
        assert svc.router.status()["used_slots"] == 0  # the dead replica's slots died with it
        # Nothing can serve: a new request is refused at once rather than left hanging.
        with pytest.raises(grpc.RpcError) as err:
            stream_tokens(svc, request(prompt, max_new=5))
        assert_unavailable_without_internals(err.value)
        assert "replica-0" in svc.destroyed  # the dead one was stopped before re-creating
        on_loop(svc, factory.open.set)
        wait_until(lambda: health(svc) == SERVING, what="health SERVING again")
        assert replica_states(svc) == {"replica-0": "serving"}
        assert svc.router.status()["replicas"][0]["restarts"] == 1
        channel, stub = svc.stub()
        with channel:  # the gRPC Status tells it too
            status = stub.Status(generation_pb2.StatusRequest(), timeout=10)
        assert [(r.restarts, r.state) for r in status.replicas] == [(1, "serving")]
        assert status.failed == 2  # the two streams the dead replica held
        after, final = stream_tokens(svc, request(prompt, max_new=30))
        assert after == before
        assert final.speculation.accepted_tokens > 0
    finally:
        svc.stop()


def test_target_that_hangs_past_the_deadline_is_treated_as_dead():
    svc = LocalService(replicas=1, drafters=1, target_timeout_s=0.5).start()
    try:
        before, _ = stream_tokens(svc, request(REPEATING, max_new=20))
        dying_replica(svc, hang=True)
        with pytest.raises(grpc.RpcError) as err:
            stream_tokens(svc, request(REPEATING, max_new=20))
        assert_unavailable_without_internals(err.value)
        wait_until(lambda: health(svc) == SERVING and
                   replica_states(svc) == {"replica-0": "serving"}, what="restarted")
        assert stream_tokens(svc, request(REPEATING, max_new=20))[0] == before
    finally:
        svc.stop()


def test_waiting_requests_of_a_dead_replica_move_to_a_serving_one():
    svc = LocalService(replicas=2, drafters=1, max_active=1).start()
    try:
        router = svc.router
        expected = {i: greedy_solo(svc, PROMPTS[i], 25) for i in range(4)}
        gates = gate_all(svc)  # replica-1 waits at its verify gate
        factory = router.replica_factory = GatedFactory(router.replica_factory)

        async def scenario():
            dying = Dying(gates[0], hold=True)  # replica-0: held at verify, then dies
            router.replicas["replica-0"].target.inner = dying
            reqs = [router.submit(PROMPTS[i], options(25)) for i in range(4)]
            on0 = [i for i, r in enumerate(reqs) if router.placement(r) == "replica-0"]
            on1 = [i for i, r in enumerate(reqs) if router.placement(r) == "replica-1"]
            assert len(on0) == len(on1) == 2
            # One slot per replica: the first on each decodes, the second waits.
            decoding, waiting = reqs[on0[0]], reqs[on0[1]]
            await until(lambda: dying.reached.is_set() and reqs[on1[0]].slot is not None)
            assert waiting in router.replicas["replica-0"].scheduler.waiting
            dying.release.set()
            with pytest.raises(Exception) as lost:
                await collect(decoding)
            moved_to = router.placement(waiting)
            gates[1].open.set()
            outs = {i: (await collect(reqs[i]))[0] for i in (on0[1], *on1)}
            return on0, lost.value, moved_to, outs

        on0, lost, moved_to, outs = svc.call(scenario())
        assert type(lost).__name__ == "ReplicaUnavailable"
        assert moved_to == "replica-1"
        assert outs == {i: expected[i] for i in outs} and len(outs) == 3  # none lost or changed
        assert router.replicas["replica-0"].state == "restarting"
        on_loop(svc, factory.open.set)
        wait_until(lambda: router.replicas["replica-0"].state == "serving", what="restarted")
    finally:
        svc.stop()


def test_scale_down_removes_the_dead_replica_and_keeps_the_healthy_one():
    svc = LocalService(replicas=1, drafters=1).start()
    try:
        before, _ = stream_tokens(svc, request(REPEATING, max_new=20))
        dying = dying_replica(svc, hold=False)
        # replica-0's re-creation stays pending; new replicas start at once.
        svc.router.replica_factory = GatedFactory(svc.router.replica_factory, {"replica-0"})
        dying.dead = True  # dies while idle: the Status call's probe finds it
        assert replica_states(svc) == {"replica-0": "restarting"}
        wait_until(lambda: health(svc) == NOT_SERVING, what="health NOT_SERVING")
        channel, stub = svc.stub()
        with channel:
            up = stub.Scale(generation_pb2.ScaleRequest(target_replicas=2), timeout=60)
            assert list(up.added) == ["replica-1"] and up.target_replicas == 1
            assert replica_states(svc) == {"replica-0": "restarting", "replica-1": "serving"}
            assert health(svc) == SERVING
            down = stub.Scale(generation_pb2.ScaleRequest(target_replicas=1), timeout=60)
        assert list(down.removed) == ["replica-0"] and down.target_replicas == 1
        assert list(svc.router.replicas) == ["replica-1"] and list(svc.engines) == ["replica-1"]
        assert health(svc) == SERVING
        assert stream_tokens(svc, request(REPEATING, max_new=20))[0] == before
    finally:
        svc.stop()


def test_a_failed_re_creation_shows_failed_and_is_retried():
    svc = LocalService(replicas=1, drafters=1, restart_delay_s=0.01).start()
    try:
        before, _ = stream_tokens(svc, request(REPEATING, max_new=20))
        dying = dying_replica(svc, hold=False)
        real = svc.router.replica_factory
        attempts = []
        second = asyncio.Event()

        async def flaky(name):  # the first attempt fails; the second waits for the test
            attempts.append(name)
            if len(attempts) == 1:
                raise RuntimeError("no resources")
            await second.wait()
            return await real(name)

        svc.router.replica_factory = flaky
        dying.dead = True
        with pytest.raises(grpc.RpcError) as err:
            stream_tokens(svc, request(REPEATING, max_new=20))
        assert_unavailable_without_internals(err.value)
        wait_until(lambda: len(attempts) == 2, what="a second attempt")
        assert replica_states(svc) == {"replica-0": "failed"}
        assert health(svc) == NOT_SERVING
        on_loop(svc, second.set)
        wait_until(lambda: health(svc) == SERVING, what="health SERVING again")
        assert replica_states(svc) == {"replica-0": "serving"} and attempts == ["replica-0"] * 2
        assert stream_tokens(svc, request(REPEATING, max_new=20))[0] == before
    finally:
        svc.stop()


def test_killed_drafter_is_marked_unhealthy_replaced_and_drafting_resumes():
    svc = LocalService(replicas=1, drafters=1).start()
    try:
        pool = svc.router.pool
        expected = greedy_solo(svc, REPEATING, 60)
        factory = svc.router.drafter_factory = GatedFactory(svc.router.drafter_factory)
        (gate,) = gate_all(svc)
        running = run_in_thread(stream_tokens, svc, request(REPEATING, max_new=60))
        wait_until(lambda: svc.router.status()["active_requests"] == 1, what="mid-stream")
        svc.stop_drafter()  # its gRPC server is gone: Propose calls fail
        on_loop(svc, gate.open.set)
        tokens, final = running.result(timeout=60)
        assert tokens == expected  # undrafted steps never change an output
        assert final.speculation.drafter_failures > 0

        def drafter_states():
            channel, stub = svc.stub()
            with channel:
                status = stub.Status(generation_pb2.StatusRequest(), timeout=10)
            return {d.name: (d.state, d.errors) for d in status.drafters}

        state, errors = drafter_states()["drafter-0"]
        assert state == "unhealthy" and errors >= pool.unhealthy_after
        assert factory.calls == 1
        on_loop(svc, factory.open.set)
        wait_until(lambda: drafter_states()["drafter-0"][0] == "serving", what="replaced")
        member = pool.members["drafter-0"]
        assert member.restarts == 1
        channel, stub = svc.stub()
        with channel:
            status = stub.Status(generation_pb2.StatusRequest(), timeout=10)
        assert [(d.name, d.restarts) for d in status.drafters] == [("drafter-0", 1)]
        tokens, final = stream_tokens(svc, request(REPEATING, max_new=60))
        assert tokens == expected
        assert final.speculation.drafter_failures == 0
        assert final.speculation.accepted_tokens > 0  # drafted by the replacement
        assert member.client.stats["calls"] > 0 and member.client.stats["errors"] == 0
        assert drafter_states()["drafter-0"][1] >= errors  # counters carry on
    finally:
        svc.stop()


def test_pool_marks_a_failing_member_unhealthy_and_moves_its_requests():
    def jobs(*ids):
        return [ProposeJob(request_id=i, history=[1, 2, 3], max_len=2) for i in ids]

    async def scenario():
        unhealthy = []
        pool = DrafterPool(unhealthy_after=2, on_unhealthy=unhealthy.append)
        a, b = FakeClient("a", fail=True), FakeClient("b")
        pool.add("a", a)
        await pool.propose(jobs("r1", "r2"))
        assert unhealthy == [] and pool.members["a"].state == "serving"
        await pool.propose(jobs("r1", "r2"))  # the second failure in a row
        assert unhealthy == ["a"]
        assert pool.members["a"].state == "unhealthy" and not pool.members["a"].assigned
        assert [len(x) for x in await pool.propose(jobs("r1"))] == [0]
        assert len(a.seen) == 2  # an unhealthy member gets no calls
        pool.add("b", b)  # its requests go to another member
        blocks = await pool.propose(jobs("r1", "r2"))
        assert b.seen == [["r1", "r2"]] and [len(x) for x in blocks] == [2, 2]
        await pool.stop_worker("a")
        fresh = FakeClient("a2")
        pool.replace("a", fresh)
        status = {s["name"]: s for s in pool.status()}["a"]
        assert status["state"] == "serving" and status["restarts"] == 1
        assert status["errors"] == 2 and status["calls"] == 2  # the old worker's count stays
        await pool.propose(jobs("r4"))
        assert fresh.seen == [["r4"]]

    asyncio.run(scenario())


@pytest.mark.parametrize("value", [0, -1.0, True, "60"])
def test_target_timeout_must_be_a_positive_number(value):
    from coordinator.cluster.config import ServiceConfig
    from coordinator.cluster.service import Service

    with pytest.raises(ValueError, match="target_timeout_s"):
        Service(ServiceConfig(model="tiny-random", target_timeout_s=value))
