"""Replicas and drafter pools (`coordinator.cluster.router`, `coordinator.cluster.drafter_pool`) on
the tiny random model, in process: placement, scaling while requests run, draining, Scale validation
and the metrics Status reports. Outputs are compared with solo runs of the core loop."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from polling import wait_until
from service_harness import MODEL, LocalService, run_in_thread
from test_service import REPEATING, request, solo, stream_tokens

from coordinator.cluster.drafter_pool import DrafterPool
from coordinator.cluster.replica import RateMeter
from coordinator.cluster.router import Router
from coordinator.step.speculative import speculative_decode_with
from drafter_worker.client import DrafterUnavailable
from drafter_worker.prompt_lookup import PromptLookupSpeculator
from specd.v1 import generation_pb2, generation_pb2_grpc
from specd_core.draft import DraftBlock
from specd_core.request import SpeculativeDecodeResult, SpeculativeOptions

PROMPTS = [REPEATING, [11, 3, 40, 22, 17, 9, 31], [2, 4, 2, 4, 2, 4], [1, 2, 3, 1, 2, 3, 1],
           [9, 9, 9, 9], [7, 1, 7, 1, 7, 1, 7, 1]]


def greedy_solo(svc: LocalService, prompt: list[int], max_new: int) -> list[int]:
    return speculative_decode_with(
        svc.decoder, prompt, svc.decoder.new_cache(), PromptLookupSpeculator(2, 6),
        SpeculativeOptions(max_new_tokens=max_new)).generated_tokens


class Gate:
    """Wraps a replica's target so its verify calls wait until the gate opens: requests stay
    mid-stream, deterministically, while the test scales around them."""

    def __init__(self, inner):
        self.inner = inner
        self.open = asyncio.Event()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def verify(self, items):
        await self.open.wait()
        return await self.inner.verify(items)


def gate_all(svc: LocalService) -> list[Gate]:
    gates = []
    for replica in svc.router.replicas.values():
        gate = Gate(replica.target.inner)
        replica.target.inner = gate
        gates.append(gate)
    return gates


async def until(condition, limit: int = 10_000) -> None:
    """Yields to the event loop until ``condition()`` holds (bounded, no wall-clock sleep)."""
    for _ in range(limit):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never held")


async def collect(req) -> tuple[list[int], SpeculativeDecodeResult]:
    tokens = []
    while True:
        event = await req.events.get()
        if isinstance(event, list):
            tokens.extend(event)
        elif isinstance(event, SpeculativeDecodeResult):
            return tokens, event
        else:
            raise event


def options(max_new: int) -> SpeculativeOptions:
    return SpeculativeOptions(max_new_tokens=max_new)


def test_two_replicas_two_drafters_twelve_concurrent_requests_equal_their_solo_runs():
    svc = LocalService(replicas=2, drafters=2).start()
    try:
        reqs = [request(PROMPTS[i % len(PROMPTS)], max_new=24 + i) for i in range(10)]
        reqs += [request(REPEATING, seed=7, temperature=1.0),
                 request([2, 4, 2, 4, 2, 4], seed=3, temperature=0.8, top_k=10)]
        expected = [solo(svc, r) for r in reqs]
        futures = [run_in_thread(stream_tokens, svc, r) for r in reqs]
        results = [f.result(timeout=120) for f in futures]
        for i, ((tokens, final), want) in enumerate(zip(results, expected, strict=True)):
            assert tokens == want, f"request {i} changed on the replicated service"
            assert final.speculation.drafter_failures == 0
        # Once they are done, the first prompt sent twice more is warm at least once:
        # placement is by load, not by prefix, so the first repeat may land on the replica
        # that did not serve it (which then keeps it warm too); the second finds it warm on
        # either.
        again = [stream_tokens(svc, reqs[0])[0] for _ in range(2)]
        assert again == [expected[0]] * 2
        channel, stub = svc.stub()
        with channel:
            status = stub.Status(generation_pb2.StatusRequest(), timeout=10)
        placed = {r.name: r.requests_placed for r in status.replicas}
        assert set(placed) == {"replica-0", "replica-1"}
        assert sum(placed.values()) == 14 and min(placed.values()) > 0, placed
        # Every emitted token is counted on the replica that produced it.
        assert sum(r.tokens_emitted for r in status.replicas) == sum(
            len(t) for t, _ in results) + sum(len(t) for t in again)
        for r in status.replicas:
            assert r.state == "serving" and r.steps > 0 and r.active_requests == 0
            assert r.step_seconds > 0 and r.forward_seconds_per_call > 0
            assert r.bytes_sent_per_step > 0 and r.bytes_received_per_step > 0
            assert 0 < r.ttft_p50_seconds <= r.ttft_p90_seconds
            assert 0 < r.itl_p50_seconds <= r.itl_p90_seconds and r.prefill_p50_seconds > 0
            assert r.prefilling_requests == 0
        assert sum(r.prefix_hits for r in status.replicas) >= 1
        assert sum(r.prefix_queries for r in status.replicas) == 14
        assert sum(r.prefix_hit_tokens for r in status.replicas) >= len(reqs[0].token_ids.ids) - 1
        # The warm prefix cache: every finished request's positions kept (well within the
        # default bound), their keys and values counted in bytes.
        assert all(0 < r.warm_positions <= 32768 for r in status.replicas)
        assert all(r.warm_bytes >= r.warm_positions for r in status.replicas)
        assert [d.name for d in status.drafters] == ["drafter-0", "drafter-1"]
        for d in status.drafters:
            assert d.calls > 0 and d.errors == 0 and d.mean_latency_seconds > 0
            assert d.assigned_requests == 0  # released when their requests finished
        assert status.total_slots == 2 * svc.max_active
    finally:
        svc.stop()


def test_removing_a_drafter_mid_request_keeps_every_output():
    svc = LocalService(replicas=1, drafters=2).start()
    try:
        prompts = PROMPTS[:4]
        expected = [greedy_solo(svc, p, 60) for p in prompts]
        (gate,) = gate_all(svc)
        pool = svc.router.pool

        async def scenario():
            reqs = [svc.router.submit(p, options(60)) for p in prompts]
            # One step has proposed for all four (spread over both drafters); verify waits.
            await until(lambda: sum(len(m.assigned) for m in pool.members.values()) == 4)
            moved = set(pool.members["drafter-0"].assigned)
            assert moved and moved != {r.id for r in reqs}, "both drafters hold requests"
            result = await svc.router.scale(drafters=1)
            assert result["removed"] == ["drafter-0"] and result["drafters"] == 1
            assert "drafter-0" not in svc.drafter_servers  # its worker is gone
            calls_before = pool.members["drafter-1"].client.stats["calls"]
            gate.open.set()
            outs = [await collect(r) for r in reqs]
            return reqs, moved, outs, calls_before

        reqs, moved, outs, calls_before = svc.call(scenario())
        for (tokens, _), want in zip(outs, expected, strict=True):
            assert tokens == want
        drafter = svc.router.pool.members["drafter-1"]
        assert drafter.client.stats["calls"] > calls_before
        assert drafter.client.stats["errors"] == 0
        # The moved requests were drafted by the remaining worker (full-history resync).
        moved_results = [res for r, (_, res) in zip(reqs, outs, strict=True) if r.id in moved]
        assert any(res.accepted_tokens > 0 for res in moved_results)
        assert all(r.drafter_failures == 0 for r in reqs)
    finally:
        svc.stop()


def test_draining_a_replica_finishes_its_requests_before_removing_it():
    svc = LocalService(replicas=2, drafters=1).start()
    try:
        prompts = PROMPTS[:4]
        later = PROMPTS[4:6]
        expected = [greedy_solo(svc, p, 40) for p in prompts + later]
        gates = gate_all(svc)
        router = svc.router

        async def scenario():
            first = [router.submit(p, options(40)) for p in prompts]
            assert {router.placement(r) for r in first} == {"replica-0", "replica-1"}
            await until(lambda: all(r.slot is not None for r in first))
            scaling = asyncio.ensure_future(router.scale(target_replicas=1))
            await until(lambda: any(r.state == "draining" for r in router.replicas.values()))
            (draining,) = [r.name for r in router.replicas.values() if r.state == "draining"]
            (other,) = [r.name for r in router.replicas.values() if r.state == "serving"]
            held = [r for r in first if router.placement(r) == draining]
            second = [router.submit(p, options(40)) for p in later]
            assert {router.placement(r) for r in second} == {other}
            status = router.status()
            assert status["replicas"][int(draining[-1])]["state"] == "draining"
            await asyncio.sleep(0)
            # Its requests are held at the gate: the replica cannot be gone yet.
            assert not scaling.done() and draining in svc.engines and held
            for gate in gates:
                gate.open.set()
            outs = [await collect(r) for r in first + second]
            result = await scaling
            return draining, other, outs, result

        draining, other, outs, result = svc.call(scenario())
        for (tokens, _), want in zip(outs, expected, strict=True):
            assert tokens == want
        assert result == {"target_replicas": 1, "drafters": 1, "added": [],
                          "removed": [draining]}
        assert svc.destroyed == {draining: 0}  # destroyed only once its slots were free
        assert list(svc.router.replicas) == [other]
        totals = svc.router.status()  # the removed replica's work still counts
        assert totals["completed"] == 6
        assert totals["tokens_generated"] == sum(len(t) for t, _ in outs)
        # A request after the scale runs on the remaining replica.
        tokens, _ = stream_tokens(svc, request(REPEATING, max_new=12))
        assert tokens == greedy_solo(svc, REPEATING, 12)
    finally:
        svc.stop()


def test_status_totals_are_the_replica_rows_cancelled_requests_included():
    """The totals' tokens are the replica rows' summed, whether their requests finished or
    were cancelled mid-stream (they read 0 while the rows showed 40 and 42)."""
    svc = LocalService(replicas=2, drafters=1).start()
    try:
        gates = gate_all(svc)
        router = svc.router

        async def submit():
            return [router.submit(p, options(40)) for p in PROMPTS[:2]]

        reqs = svc.call(submit())
        # Prefilled: each has streamed its first token and waits at its replica's gate.
        wait_until(lambda: all(r.emitted > 0 for r in reqs), what="first tokens streamed")

        async def cancel_all():
            for r in reqs:
                router.cancel(r)
            for gate in gates:
                gate.open.set()
            for r in reqs:
                with pytest.raises(asyncio.CancelledError):
                    await collect(r)
            return router.status()

        status = svc.call(cancel_all())
        rows = [r["tokens_emitted"] for r in status["replicas"]]
        assert len(rows) == 2 and all(n > 0 for n in rows), rows
        assert status["cancelled"] == 2
        assert status["tokens_generated"] == sum(rows)
    finally:
        svc.stop()


def test_new_requests_go_to_the_least_loaded_replica():
    svc = LocalService(replicas=2, drafters=1).start()
    try:
        gates = gate_all(svc)
        router = svc.router

        async def scenario():
            long = router.submit(REPEATING, options(100))   # replica-0: 100 tokens to go
            short = router.submit(REPEATING, options(10))   # replica-1: 10 tokens to go
            nxt = router.submit([1, 2, 3], options(5))      # both hold one: fewer tokens wins
            placements = [router.placement(r) for r in (long, short, nxt)]
            for gate in gates:
                gate.open.set()
            for r in (long, short, nxt):
                await collect(r)
            return placements

        assert svc.call(scenario()) == ["replica-0", "replica-1", "replica-1"]
    finally:
        svc.stop()


def test_scale_up_while_serving_then_requests_use_the_new_replica():
    svc = LocalService(replicas=1, drafters=1).start()
    try:
        channel, stub = svc.stub()
        with channel:
            running = [run_in_thread(stream_tokens, svc, request(p, max_new=40))
                       for p in PROMPTS[:3]]
            reply = stub.Scale(generation_pb2.ScaleRequest(target_replicas=2, drafters=2),
                               timeout=60)
            assert (reply.target_replicas, reply.drafters) == (2, 2)
            assert sorted(reply.added) == ["drafter-1", "replica-1"]
            after = [run_in_thread(stream_tokens, svc, request(p, max_new=20))
                     for p in PROMPTS[3:]]
            for f, p in zip(running, PROMPTS[:3], strict=True):
                assert f.result(timeout=120)[0] == greedy_solo(svc, p, 40)
            for f, p in zip(after, PROMPTS[3:], strict=True):
                assert f.result(timeout=120)[0] == greedy_solo(svc, p, 20)
            status = stub.Status(generation_pb2.StatusRequest(), timeout=10)
        placed = {r.name: r.requests_placed for r in status.replicas}
        assert placed["replica-1"] > 0
        assert len(status.drafters) == 2
    finally:
        svc.stop()


@pytest.mark.parametrize("fields,field", [
    ({"target_replicas": 0}, "target_replicas"),
    ({"target_replicas": -2}, "target_replicas"),
    ({"target_replicas": 10_000}, "target_replicas"),
    ({"drafters": -1}, "drafters"),
    ({"drafters": 1, "target_replicas": 0}, "target_replicas"),
])
def test_bad_scale_counts_are_invalid_argument_and_nothing_in_flight_is_lost(fields, field):
    svc = LocalService(replicas=1, drafters=1).start()
    try:
        prompts = PROMPTS[:3]
        running = [run_in_thread(stream_tokens, svc, request(p, max_new=40)) for p in prompts]
        channel, stub = svc.stub()
        with channel:
            with pytest.raises(grpc.RpcError) as err:
                stub.Scale(generation_pb2.ScaleRequest(**fields), timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details().startswith(field)
            for f, p in zip(running, prompts, strict=True):
                assert f.result(timeout=120)[0] == greedy_solo(svc, p, 40)
            status = stub.Status(generation_pb2.StatusRequest(), timeout=10)
        assert [r.name for r in status.replicas] == ["replica-0"]
        assert [d.name for d in status.drafters] == ["drafter-0"]
        assert svc.destroyed == {}
    finally:
        svc.stop()


def test_scale_needs_the_bearer_token():
    svc = LocalService(auth_token="s3cret").start()
    try:
        with grpc.insecure_channel(svc.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            with pytest.raises(grpc.RpcError) as err:
                stub.Scale(generation_pb2.ScaleRequest(drafters=2), timeout=30)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert len(svc.router.pool.members) == 1
    finally:
        svc.stop()


def test_router_refuses_drafters_without_a_drafter_factory():
    async def replica(name):
        raise AssertionError("not started: validation comes first")

    router = Router(replica, drafter_factory=None)
    with pytest.raises(ValueError, match="drafters: .*without a drafter"):
        asyncio.run(router.scale(target_replicas=1, drafters=1))
    with pytest.raises(ValueError, match=r"target_replicas: .*got 1\.5"):
        asyncio.run(router.scale(target_replicas=1.5))
    with pytest.raises(ValueError, match="target_replicas: .*got True"):
        asyncio.run(router.scale(target_replicas=True))


class FakeClient:
    def __init__(self, name, fail=False):
        self.address = name
        self.fail = fail
        self.stats = {"calls": 0, "errors": 0, "latency_s": 0.0}
        self.seen: list[list[str]] = []
        self.released: list[str] = []

    async def propose(self, jobs):
        self.stats["calls"] += 1
        self.seen.append([j.request_id for j in jobs])
        if self.fail:
            self.stats["errors"] += 1
            raise DrafterUnavailable("down")
        return [DraftBlock.deterministic([1] * j.max_len) for j in jobs]

    async def release(self, ids):
        self.released.extend(ids)

    async def close(self):
        pass


def test_drafter_pool_sticky_assignment_and_failover():
    from drafter_worker.client import ProposeJob

    def jobs(*ids):
        return [ProposeJob(request_id=i, history=[1, 2, 3], max_len=2) for i in ids]

    async def scenario():
        failed = []
        pool = DrafterPool(on_failure=failed.extend)
        a, b = FakeClient("a"), FakeClient("b", fail=True)
        pool.add("a", a)
        pool.add("b", b)
        # New requests alternate over the least-assigned drafter and then stick.
        blocks = await pool.propose(jobs("r1", "r2", "r3"))
        assert a.seen == [["r1", "r3"]] and b.seen == [["r2"]]
        assert [len(x) for x in blocks] == [2, 0, 2]  # b failed: r2 undrafted this step
        assert failed == ["r2"]
        # r2 moves off the failing drafter; a new request avoids it too.
        await pool.propose(jobs("r1", "r2", "r3", "r4"))
        assert a.seen[-1] == ["r1", "r2", "r3", "r4"] and len(b.seen) == 1
        status = {s["name"]: s for s in pool.status()}
        assert status["a"]["assigned_requests"] == 4 and status["b"]["errors"] == 1
        await pool.release(["r1"])
        assert a.released == ["r1"]
        await pool.remove("a")
        # Only b is left: it is used (and fails) rather than nothing.
        blocks = await pool.propose(jobs("r2"))
        assert b.seen[-1] == ["r2"] and len(blocks[0]) == 0
        await pool.remove("b")
        assert [len(b) for b in await pool.propose(jobs("r2"))] == [0]

    asyncio.run(scenario())


def test_rate_meter_counts_the_window_only():
    now = [100.0]
    meter = RateMeter(window_s=10.0, clock=lambda: now[0])
    meter.add(30)
    now[0] = 105.0
    meter.add(20)
    assert meter.rate() == pytest.approx(5.0)
    now[0] = 112.0  # the first event left the window
    assert meter.rate() == pytest.approx(2.0)
    now[0] = 200.0
    assert meter.rate() == 0.0


def test_prometheus_export_labels_every_replica_and_drafter():
    pytest.importorskip("prometheus_client")
    import urllib.request

    from coordinator.cluster.metrics import start_exporter

    svc = LocalService(replicas=2, drafters=2).start()
    try:
        futures = [run_in_thread(stream_tokens, svc, request(p, max_new=16)) for p in PROMPTS]
        total = sum(len(f.result(timeout=120)[0]) for f in futures)
        server, port = start_exporter(svc.router, svc.loop, "127.0.0.1", 0)
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
                text = r.read().decode()
        finally:
            server.shutdown()
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                samples[name] = float(value)
        emitted = [samples[f'specd_replica_tokens_total{{replica="replica-{i}"}}']
                   for i in (0, 1)]
        assert sum(emitted) == total and min(emitted) > 0
        for i in (0, 1):
            assert samples[f'specd_drafter_calls_total{{drafter="drafter-{i}"}}'] > 0
            assert samples[f'specd_drafter_errors_total{{drafter="drafter-{i}"}}'] == 0
            assert samples[f'specd_replica_step_seconds{{replica="replica-{i}"}}'] > 0
        # The latency histograms: one first token per request, one prefill each, and an
        # inter-token gap per later streamed chunk, added up over the replicas.
        placed = [samples[f'specd_replica_requests_placed_total{{replica="replica-{i}"}}']
                  for i in (0, 1)]
        for name in ("time_to_first_token", "request_prefill_time"):
            counts = [samples[f'specd_{name}_seconds_count{{replica="replica-{i}"}}']
                      for i in (0, 1)]
            assert counts == placed
            assert all(samples[f'specd_{name}_seconds_bucket{{le="+Inf",replica="replica-{i}"}}']
                       == c for i, c in zip((0, 1), counts, strict=True))
        warm = [samples[f'specd_replica_warm_positions{{replica="replica-{i}"}}'] for i in (0, 1)]
        assert min(warm) > 0
        assert all(samples[f'specd_replica_warm_bytes{{replica="replica-{i}"}}'] > 0
                   for i in (0, 1))
        assert sum(samples[f'specd_replica_prefix_queries_total{{replica="replica-{i}"}}']
                   for i in (0, 1)) == len(PROMPTS)
        gaps = sum(samples[f'specd_inter_token_latency_seconds_count{{replica="replica-{i}"}}']
                   for i in (0, 1))
        assert 0 < gaps <= total - len(PROMPTS)
    finally:
        svc.stop()


def test_a_replica_calibrated_by_its_factory_starts_its_loop_with_that_cost_model():
    # The service calibrates while starting a replica (start-up work, reported as a phase):
    # its loop must not calibrate again inside the first request.
    from coordinator.cluster.router import Router
    from coordinator.step.adaptive import ForwardCostModel
    from coordinator.step.targets import LocalTarget
    from target_worker.engine import TargetEngine
    from target_worker.loader import load_model

    decoder = load_model(MODEL)[0]
    calibrated = ForwardCostModel({1: 0.01, 8: 0.02})

    async def factory(name):
        async def stop() -> None:
            pass

        return LocalTarget(TargetEngine(decoder)), stop, {
            "vocab_size": decoder.config.vocab_size, "cost_model": calibrated}

    async def go():
        router = Router(factory, None, adaptive=True, probe_interval_s=None)
        await router.scale(target_replicas=1)
        replica = next(iter(router.replicas.values()))
        try:
            return replica.scheduler.cost_model, dict(replica.info)
        finally:
            await router.close()

    cost_model, info = asyncio.run(go())
    assert cost_model is calibrated and "cost_model" not in info
